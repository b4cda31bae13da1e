"""A shard without rows (more shards than rows or conversations) starts no engine and claims no GPU: extract
writes its files of shape [0, H] from config.json, regenerate its empty folder, each with a manifest that says
no engine started. Neither needs vLLM installed (this file runs in the base environment, which has none)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

import eagle3prep.regenerate.engine as engine_module
from eagle3prep.backends.empty import CAPTURE_PATH, EmptyShardBackend
from eagle3prep.extract import stage as extract
from eagle3prep.regenerate import (
    RegenerateJobSettings,
    RegeneratePaths,
    merge_shards,
    run_regenerate_job,
    split_conversations,
)
from eagle3prep.regenerate import stage as regen_stage
from eagle3prep.settings import ExtractSettings, RegenerateSettings

from testkit import calls
from testkit.regenerate import U1, conv, run_shard
from testkit.shards import DEMO_LAYER_IDS, capture_spec, with_settings

H = 128  # the demo model's hidden size


def no_engine(*args, **kwargs):
    pytest.fail("an engine or a GPU claim was started for a shard without rows")


@pytest.mark.parametrize(("backend", "engine"), [("vllm", "vllm"), ("hf", "transformers")])
def test_an_empty_extract_shard_starts_no_engine_and_validates(backend, engine, tmp_path, demo_model_dir, monkeypatch):
    import transformers

    monkeypatch.setattr(extract, "make_backend", no_engine)
    monkeypatch.setattr(extract, "claim_job_gpus", no_engine)
    tokens = tmp_path / "shard_3.jsonl"
    tokens.write_text("")
    spec = capture_spec(
        backend=backend,
        model_path=str(demo_model_dir),
        layer_ids=DEMO_LAYER_IDS,
        tp_size=2,
        dtype="bfloat16",
        device="cpu",
        max_seq_len=2048,
    )
    out = tmp_path / "shard_3"
    manifest = extract.extract_shard(
        str(tokens), str(out), with_settings(spec, ExtractSettings.defaults(batch_tokens=512)), shard=3
    )

    assert (manifest.rows, manifest.tokens, manifest.row_range) == (0, 0, [0, 0])
    assert manifest.engine["engine"] == engine and manifest.engine["capture_path"] == CAPTURE_PATH
    assert manifest.engine["engine_started"] is False
    # vLLM is not in this environment; transformers is, and the manifest names the one that would have run.
    assert manifest.engine["engine_version"] == ("not installed" if backend == "vllm" else transformers.__version__)
    for lid in DEMO_LAYER_IDS:
        assert load_file(out / f"layer_{lid}.safetensors")["hidden_states"].shape == (0, H)
    assert load_file(out / "token_ids.safetensors")["token_ids"].shape == (0,)
    report = calls.validate(out, tokens, tmp_path / "v.json", demo_model_dir)
    assert report["ok"] and report["reference_sample"]["rows"] == 0


def test_the_empty_backend_refuses_rows(demo_model_dir):
    spec = capture_spec(
        backend="hf",
        model_path=str(demo_model_dir),
        layer_ids=DEMO_LAYER_IDS,
        dtype="bfloat16",
        device="cpu",
        tp_size=1,
        max_seq_len=2048,
    )
    backend = EmptyShardBackend(spec, engine_version="4.0")
    with pytest.raises(RuntimeError, match="only writes shards without rows"):
        backend.capture_shard(iter([[[1, 2, 3]]]), None)


def test_an_empty_regenerate_shard_starts_no_engine_and_merges(tmp_path, demo_model_dir, monkeypatch):
    monkeypatch.setattr(engine_module, "VLLMEngine", no_engine)
    monkeypatch.setattr(regen_stage, "claim_job_gpus", no_engine)
    prepared = tmp_path / "prepared.jsonl"
    prepared.write_text(json.dumps(conv([U1], "a")) + "\n")
    shards = [tmp_path / "prompts" / f"shard_{k}.jsonl" for k in range(2)]
    split_conversations(prepared, shards)
    assert shards[1].read_text() == ""  # one conversation for two shards

    manifest = run_regenerate_job(
        RegeneratePaths(str(shards[1]), str(tmp_path / "shard_1"), str(demo_model_dir), shard=1),
        RegenerateJobSettings(RegenerateSettings.defaults(tp_size=2), {}, trust_remote_code=False,
                              max_seq_len=1024, threads=None),  # run_shard's max_model_len
    )  # fmt: skip
    assert manifest["engine"] == {"engine": "vllm", "engine_started": False, "engine_version": "not installed"}
    assert manifest["counts"]["rows_in"] == manifest["counts"]["kept"] == 0
    assert (tmp_path / "shard_1/conversations.jsonl").read_text() == ""
    timings = json.loads((tmp_path / "shard_1/timings.json").read_text())
    assert timings["engine_start_s"] is None and timings["engine_steps"] == 0

    # Beside a shard a (fake) engine regenerated, the empty one merges: rows in = rows out.
    run_shard(str(demo_model_dir), str(shards[0]), str(tmp_path / "shard_0"), 0)
    counts_in = tmp_path / "prepared_counts.json"
    counts_in.write_text(json.dumps({"totals": {"kept": 1}}))
    merged = merge_shards(
        [tmp_path / "shard_0", tmp_path / "shard_1"], counts_in,
        tmp_path / "m.jsonl", tmp_path / "q.jsonl", tmp_path / "c.json",
    )  # fmt: skip
    assert len(Path(tmp_path / "m.jsonl").read_text().splitlines()) == 1
    assert merged["totals"]["rows_in"] == 1
