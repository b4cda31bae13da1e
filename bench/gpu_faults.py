"""The GPU fault matrix: each fault a GPU host deals a capture, made real under vLLM through the workflow's GPU rule.

Runs on a GPU host (device setup: bench/device/README.md; the step `faults` of bench/device/newest_vllm.sh):
    python bench/gpu_faults.py OUTDIR [--faults oom_start oom_mid engine_kill disk_full sigterm]

One workdir (the random Llama of gpu_validate.py, the demo conversations, one shard per fault plus one finished
before them) whose results/ is a tmpfs of its own when the host lets us mount one (root), so a full disk is a real
one (the logs stay on the host's disk, as where results/ is a data volume of its own). Shard 0
is captured and validated first; then fault i strikes the capture of shard i (`snakemake
results/validation/shard_<i>.json`), and the same command is run once more. Each row says:
- rc: the faulted run's exit status (never 0);
- line: the job's one `error:` line (cause and fix), read from its log;
- kept: every shard finished before it is untouched (its manifest's bytes and mtime);
- gpu free: the GPU's free share after the faulted run (an engine left running would hold its memory);
- rerun: the same command's exit status and the shard's validation verdict.
At the end every shard's validation is asked for at once: no finished shard may be captured again.

The faults (infra/faults.py makes each at one step inside the shard, in the engine's own process):
  oom_start    another process holds all but 0.5 GiB of the GPU when the engine starts
  oom_mid      a CUDA allocation the GPU cannot hold, at the capture's second step (torch.OutOfMemoryError)
  engine_kill  SIGKILL of the process running the model (at TP 1 the engine core is the worker) at that step
  disk_full    the results filesystem filled at that step (a real ENOSPC on the next write)
  sigterm      SIGTERM to the whole run, as a Slurm preemption sends it, between two batches
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from gpu_validate import build_target  # noqa: E402

FAULTS = ["oom_start", "oom_mid", "engine_kill", "disk_full", "sigterm"]
# The fault's kill point and scope (infra/faults.py); {k} is the faulted shard.
PLANTED = {
    "oom_mid": ("capture.step:dir=shard_{k},step=2", "cuda_oom"),
    "engine_kill": ("capture.step:dir=shard_{k},step=2", "process"),
    "disk_full": ("capture.step:dir=shard_{k},step=2", "fill"),
    "sigterm": ("extract.between_batches:shard={k},batch=1", "term"),
}
HOG = """
import sys, time, torch
free, total = torch.cuda.mem_get_info()
hold = torch.empty(free - (1 << 29), dtype=torch.uint8, device="cuda")
print("holding", hold.numel() >> 30, "GiB of", total >> 30, flush=True)
time.sleep(3600)
"""


def snakemake(wd: Path, *targets: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    exe = Path(sys.executable).with_name("snakemake")
    cmd = [str(exe) if exe.exists() else "snakemake", "--snakefile", str(REPO / "Snakefile"), *targets]
    t0 = time.time()
    proc = subprocess.run(
        [*cmd, "--cores", "8", "--resources", "gpu=1"],
        cwd=wd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        start_new_session=True,  # a planted SIGTERM goes to the run's process group, not to this bench
    )
    return proc, time.time() - t0


def finished(wd: Path) -> dict[str, tuple[str, int]]:
    """Every finished shard's manifest: sha256 and mtime_ns."""
    out = {}
    for m in sorted((wd / "results/hidden_states").glob("shard_*/manifest.json")):
        out[m.parent.name] = (hashlib.sha256(m.read_bytes()).hexdigest()[:16], m.stat().st_mtime_ns)
    return out


def error_line(wd: Path, k: int, proc: subprocess.CompletedProcess) -> str:
    log = wd / f"logs/extract/shard_{k}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    if lines:
        return lines[-1] + ("" if len(lines) == 1 else f" ({len(lines)} error lines)")
    return "NO ONE-LINE ERROR; log tail: " + " | ".join(text.splitlines()[-5:] + proc.stderr.splitlines()[-5:])


def gpu_free_share() -> float:
    import torch

    free, total = torch.cuda.mem_get_info()
    return free / total


def mount_tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]).returncode == 0


def make_workdir(wd: Path, model: Path, shards: int) -> None:
    (wd / "config").mkdir(parents=True, exist_ok=True)
    (wd / "resources").symlink_to(REPO / "resources")
    cfg = {
        "data": {"sources": ["resources/demo/sharegpt.jsonl", "resources/demo/openai.jsonl"]},
        "model": {"path": str(model), "build_demo": False},
        "tokenize": {"max_seq_len": 512, "num_shards": shards},
        "extract": {
            "backend": "vllm",
            "dtype": "bfloat16",
            "enforce_eager": True,
            "gpu_memory_utilization": 0.5,
            "batch_tokens": 2048,
            "max_num_batched_tokens": 2048,  # several engine steps a shard: the faults strike the second
        },
        "validate": {"sample_rows": 4, "device": "cuda"},
    }
    (wd / "config/config.yaml").write_text(yaml.safe_dump(cfg))


def strike(wd: Path, fault: str, k: int) -> dict:
    target = f"results/validation/shard_{k}.json"
    before = finished(wd)
    env, hog = {}, None
    if fault == "oom_start":
        hog = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
        print(f"  hog: {hog.stdout.readline().strip()}", flush=True)
    else:
        spec, scope = PLANTED[fault]
        env = {
            "EAGLE3PREP_KILL_AT": spec.format(k=k),
            "EAGLE3PREP_KILL_SCOPE": scope,
            "EAGLE3PREP_FILL_DIR": str(wd / "results"),
        }
    try:
        proc, wall = snakemake(wd, target, env=env)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    time.sleep(5)  # an engine process the job left behind would still hold the GPU now
    row = {
        "fault": fault,
        "shard": k,
        "rc": proc.returncode,
        "wall_s": round(wall, 1),
        "line": error_line(wd, k, proc),
        "kept": {s: finished(wd).get(s) == v for s, v in before.items()},
        "gpu_free": round(gpu_free_share(), 3),
    }
    (wd / "results/e3p-fill").unlink(missing_ok=True)  # the user frees the disk
    again, wall = snakemake(wd, target)
    row["rerun_rc"], row["rerun_s"] = again.returncode, round(wall, 1)
    val = wd / target
    row["validation_ok"] = json.loads(val.read_text())["ok"] if val.exists() else None
    if again.returncode:
        row["rerun_error"] = error_line(wd, k, again)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--faults", nargs="+", default=FAULTS, choices=FAULTS)
    ap.add_argument("--tmpfs", default="8G", help="size of the workdir's own tmpfs (a real full disk)")
    args = ap.parse_args()
    import torch
    import vllm

    model = build_target(Path(os.environ.get("TMPDIR", "/tmp")) / "e3p-gpu-target" / "model")
    wd = args.out / "wd"
    on_tmpfs = mount_tmpfs(wd / "results", args.tmpfs)
    make_workdir(wd, model, shards=len(args.faults) + 1)
    where = f"its own tmpfs of {args.tmpfs}" if on_tmpfs else "the host disk (no tmpfs could be mounted)"
    print(
        f"# {torch.cuda.get_device_name(0)}, vLLM {vllm.__version__}, torch {torch.__version__}; results/ on {where}"
    )
    first, wall = snakemake(wd, "results/validation/shard_0.json")
    assert first.returncode == 0, first.stderr[-4000:]
    print(f"shard 0 captured and validated in {wall:.0f} s")
    print("| fault | shard | rc | the job's one line | finished kept | GPU free after | rerun rc | rerun s | valid |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows, ok = [], True
    for k, fault in enumerate(args.faults, start=1):
        if fault == "disk_full" and not on_tmpfs:
            print(f"| {fault} | {k} | skipped: no tmpfs could be mounted (not root) | | | | | | |")
            snakemake(wd, f"results/validation/shard_{k}.json")
            continue
        r = strike(wd, fault, k)
        rows.append(r)
        kept = all(r["kept"].values())
        good = r["rc"] != 0 and r["line"].startswith("error: ") and kept and r["rerun_rc"] == 0 and r["validation_ok"]
        ok &= bool(good)
        print(
            f"| {fault} | {k} | {r['rc']} | {r['line']} | {kept} ({len(r['kept'])}) | {r['gpu_free']:.0%} | "
            f"{r['rerun_rc']} | {r['rerun_s']} | {r['validation_ok']} |",
            flush=True,
        )
        (args.out / "gpu_faults.json").write_text(json.dumps(rows, indent=1))
    before = finished(wd)
    final, wall = snakemake(wd, *(f"results/validation/shard_{k}.json" for k in range(len(args.faults) + 1)))
    redone = [s for s, v in before.items() if finished(wd).get(s) != v]
    print(
        f"every shard's validation after the faults: rc {final.returncode} in {wall:.0f} s, "
        f"finished shards captured again: {redone or 'none'}"
    )
    ok &= final.returncode == 0 and not redone
    print("GPU FAULT MATRIX:", "PASS" if ok else "FAIL")
    if on_tmpfs:
        subprocess.run(["umount", "-l", str(wd / "results")])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
