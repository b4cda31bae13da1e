"""Every job that uses a GPU claims it: two jobs of each kind run at once on a fake 2-GPU host and
must see disjoint CUDA_VISIBLE_DEVICES (extract with hf on cuda, extract with vllm, validate on cuda,
regenerate).

The engine is replaced by a fake that records the GPUs it was given and holds them for a moment, so
the test needs no GPU; the claim itself (lock files, environment) is the production code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from eagle3prep.settings import ExtractSettings

from testkit.shards import demo_spec, with_settings, write_tokenized

HOLD_S = 3.0  # long enough that the two jobs overlap

EXTRACT_JOB = """
import json, os, sys, time
from eagle3prep.extract import stage as extract
from eagle3prep.backends.base import CaptureSpec
from eagle3prep.settings import ExtractSettings

class Recorder:
    def __init__(self, spec):
        pass
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        pass
    def probe(self):
        json.dump({"visible": os.environ.get("CUDA_VISIBLE_DEVICES")}, open(sys.argv[2], "w"))
        time.sleep(float(sys.argv[5]))
        raise SystemExit(0)

extract.make_backend = Recorder
settings = ExtractSettings.defaults(backend=sys.argv[3], dtype="bfloat16", device="cuda", tp_size=1, batch_tokens=512)
spec = CaptureSpec(settings, model_path=sys.argv[4], layer_ids=[2, 4, 5, 8], max_seq_len=2048)
extract.extract_shard(sys.argv[1], sys.argv[2] + ".shard", spec, 0)
"""

VALIDATE_JOB = """
import json, os, sys, time
from eagle3prep.validate import stage

class Recorder:
    def __init__(self, *args):
        json.dump({"visible": os.environ.get("CUDA_VISIBLE_DEVICES")}, open(sys.argv[2], "w"))
        time.sleep(float(sys.argv[5]))
        raise SystemExit(0)

stage.ReferencePair = Recorder
stage.validate_shard(sys.argv[3], sys.argv[1], sys.argv[2] + ".json", sys.argv[4], sample_rows=1, seed=0, device="cuda",
                    reference=True, trust_remote_code=False, windows=None)
"""

REGENERATE_JOB = """
import json, os, sys, time
from eagle3prep.regenerate import engine, stage
from eagle3prep.settings import RegenerateSettings

class Recorder:
    def __init__(self, *args):
        pass
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        pass
    def start(self):
        json.dump({"visible": os.environ.get("CUDA_VISIBLE_DEVICES")}, open(sys.argv[2], "w"))
        time.sleep(float(sys.argv[5]))
        raise SystemExit(0)

engine.VLLMEngine = Recorder  # run_regenerate_job imports it from there when it runs
stage.run_regenerate_job(stage.RegeneratePaths(sys.argv[1], sys.argv[2] + ".shard", sys.argv[4], shard=0),
                         stage.RegenerateJobSettings(RegenerateSettings.defaults(tp_size=1), {},
                                                     trust_remote_code=False, max_seq_len=256, threads=None))
"""
JOBS = {"validate": VALIDATE_JOB, "regenerate": REGENERATE_JOB}


@pytest.fixture(scope="module")
def shard(demo_model_dir, tmp_path_factory):
    from eagle3prep.extract import extract_shard

    root = tmp_path_factory.mktemp("claims")
    tokens = write_tokenized(root / "tokens.jsonl", [12, 9], seed=0)
    extract_shard(
        str(tokens),
        str(root / "shard_0"),
        with_settings(demo_spec(demo_model_dir), ExtractSettings.defaults(batch_tokens=64)),
        shard=0,
    )
    return tokens, root / "shard_0"


@pytest.mark.parametrize("job", ["extract-hf", "extract-vllm", "validate", "regenerate"])
def test_two_gpu_jobs_at_once_claim_disjoint_gpus(job, shard, demo_model_dir, tmp_path):
    tokens, shard_dir = shard
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOBS.get(job, EXTRACT_JOB)))
    target = str(shard_dir) if job == "validate" else job.removeprefix("extract-")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(EAGLE3PREP_NUM_GPUS="2", EAGLE3PREP_GPU_LOCK_DIR=str(tmp_path / "locks"))
    outs = [tmp_path / f"seen_{k}.json" for k in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tokens), str(out), target, str(demo_model_dir), str(HOLD_S)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for out in outs
    ]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    seen = [json.loads(out.read_text())["visible"] for out in outs]
    assert sorted(seen) == ["0", "1"], (seen, errors)  # one GPU each, never the same one


def test_timings_record_the_claimed_gpus_and_when(shard, demo_model_dir, tmp_path, monkeypatch):
    """timings.json names the GPUs a job claimed and its wall-clock times, so a bench can check that jobs
    running at once held different GPUs. The hf backend runs on the CPU here; the
    spec asks for cuda so that the job claims one GPU of the fake 2-GPU host."""

    from eagle3prep.extract import stage as extract
    from eagle3prep.extract.backend import make_backend

    tokens, _ = shard
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("EAGLE3PREP_NUM_GPUS", "2")
    monkeypatch.setenv("EAGLE3PREP_GPU_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(
        extract,
        "make_backend",
        lambda spec: make_backend(with_settings(spec, device="cpu")),
    )
    spec = with_settings(demo_spec(demo_model_dir), ExtractSettings.defaults(batch_tokens=64), device="cuda")
    extract.extract_shard(str(tokens), str(tmp_path / "shard_0"), spec, shard=0)
    timings = json.loads((tmp_path / "shard_0" / "timings.json").read_text())
    claim = timings["gpu_claim"]
    assert claim["ids"] == [0] and claim["source"] == "locks" and claim["cuda_visible_devices"] == "0"
    assert timings["started_at"] <= claim["claimed_at"] <= timings["capture_started_at"] <= timings["capture_ended_at"]
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # released with the claim
