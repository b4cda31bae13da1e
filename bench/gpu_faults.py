"""The GPU fault matrix: each fault a GPU host deals a capture, made real under vLLM through the workflow's GPU rule.

Runs on a GPU host (device setup: bench/device/README.md; the step `faults` of bench/device/newest_vllm.sh):
    python bench/gpu_faults.py OUTDIR [--faults oom_start oom_mid engine_kill disk_full sigterm] [--parallel]

One workdir (the random Llama of gpu_validate.py, the demo conversations, one shard per fault plus one finished
before them) whose results/ is a tmpfs of its own when the host lets us mount one (root), so a full disk is a real
one (the logs stay on the host's disk, as where results/ is a data volume of its own). Shard 0
is captured and validated first; then fault i strikes the capture of shard i (`snakemake
results/validation/shard_<i>.json`), and the same command is run once more. Each row says:
- rc: the faulted run's exit status (never 0);
- line: the job's one `error:` line (cause and fix), read from its log;
- kept: every shard finished before it is untouched (its manifest's bytes and mtime);
- left: processes of the faulted run still alive after it ended (an engine left behind would hold the GPU), and
  the GPU's free share then (with --parallel the other rows' engines share the GPU, so only the first counts);
- rerun: the same command's exit status and the shard's validation verdict.
At the end every shard's validation is asked for at once: no finished shard may be captured again.
--parallel gives each fault a workdir of its own (its shard 0, then its fault on shard 1), all at once, each
engine with a fixed KV cache (vLLM's memory profile fails when another process frees memory meanwhile) and a GPU lock
folder of its own (the host-wide claim, infra/gpus.py, would run them one after another): the rows in the time of
one (oom_start holds the whole GPU, so it stays out of a parallel run).

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
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from gpu_validate import build_target  # noqa: E402

FAULTS = ["oom_start", "oom_mid", "engine_kill", "disk_full", "sigterm"]
OWN = "own_locks_"  # a --parallel workdir's name: its jobs claim the GPU in a lock folder of their own
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


HANG_S = 420  # a faulted run still going then waits for good: killed, its row says "hung" (minutes, not the run)


def snakemake(wd: Path, *targets: str, env: dict | None = None, limit: float | None = None):
    exe = Path(sys.executable).with_name("snakemake")
    cmd = [str(exe) if exe.exists() else "snakemake", "--snakefile", str(REPO / "Snakefile"), *targets]
    t0 = time.time()
    # a session of its own: a planted SIGTERM goes to the run's process group, not to this bench, and what the run
    # leaves alive is found by its session id (the leader's pid)
    own = {"EAGLE3PREP_GPU_LOCK_DIR": str(wd / ".gpu-locks")} if wd.name.startswith(OWN) else {}
    popen = subprocess.Popen(
        [*cmd, "--cores", "4", "--resources", "gpu=1"],
        cwd=wd,
        env={**os.environ, **own, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = popen.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        out, err = popen.communicate()
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, out, err)
    proc.sid, proc.hung = popen.pid, limit is not None and time.time() - t0 >= limit  # type: ignore[attr-defined]
    return proc, time.time() - t0


def left_alive(sid: int) -> list[int]:
    """Processes of the session `sid` still alive (an engine the run left behind)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


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


def make_workdir(wd: Path, model: Path, shards: int, shared_gpu: bool = False) -> None:
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
    if shared_gpu:
        cfg["extract"].update(gpu_memory_utilization=0.15, engine_args={"kv_cache_memory_bytes": 2 << 30})
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
        proc, wall = snakemake(wd, target, env=env, limit=HANG_S)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    time.sleep(5)  # an engine process the job left behind would still hold the GPU now
    row = {
        "fault": fault,
        "shard": k,
        "rc": f"hung (killed after {HANG_S} s)" if proc.hung else proc.returncode,
        "wall_s": round(wall, 1),
        "line": error_line(wd, k, proc),
        "kept": {s: finished(wd).get(s) == v for s, v in before.items()},
        "left": left_alive(proc.sid),
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


def table_row(r: dict) -> tuple[str, bool]:
    kept = all(r["kept"].values())
    stopped = isinstance(r["rc"], int) and r["rc"] != 0 and r["line"].startswith("error: ") and kept and not r["left"]
    good = stopped and r["rerun_rc"] == 0 and r["validation_ok"]
    line = (
        f"| {r['fault']} | {r['shard']} | {r['rc']} | {r['line']} | {kept} ({len(r['kept'])}) | "
        f"{len(r['left'])} | {r['gpu_free']:.0%} | {r['rerun_rc']} | {r['rerun_s']} | {r['validation_ok']} |"
    )
    return line, bool(good)


def run_rows(wd: Path, model: Path, faults: list[str], tmpfs: str, shared_gpu: bool) -> tuple[list[str], bool]:
    """One workdir: shard 0 captured and validated, then each fault on the next shard, then every shard at once."""
    on_tmpfs = mount_tmpfs(wd / "results", tmpfs)
    make_workdir(wd, model, shards=len(faults) + 1, shared_gpu=shared_gpu)
    first, wall = snakemake(wd, "results/validation/shard_0.json")
    assert first.returncode == 0, first.stderr[-4000:]
    lines, ok = [f"{wd.name}: shard 0 captured and validated in {wall:.0f} s; results/ on "
                 + (f"its own tmpfs of {tmpfs}" if on_tmpfs else "the host disk")], True  # fmt: skip
    rows = []
    for k, fault in enumerate(faults, start=1):
        if fault == "disk_full" and not on_tmpfs:
            lines.append(f"| {fault} | {k} | skipped: no tmpfs could be mounted (not root) | | | | | | | |")
            snakemake(wd, f"results/validation/shard_{k}.json")
            continue
        rows.append(r := strike(wd, fault, k))
        line, good = table_row(r)
        ok &= good
        lines.append(line)
        print(line, flush=True)
        (wd / "gpu_faults.json").write_text(json.dumps(rows, indent=1))
    before = finished(wd)
    final, wall = snakemake(wd, *(f"results/validation/shard_{k}.json" for k in range(len(faults) + 1)))
    redone = [s for s, v in before.items() if finished(wd).get(s) != v]
    lines.append(f"{wd.name}: every shard's validation after the faults: rc {final.returncode} in {wall:.0f} s, "
                 f"finished shards captured again: {redone or 'none'}")  # fmt: skip
    ok &= final.returncode == 0 and not redone
    if on_tmpfs:
        subprocess.run(["umount", "-l", str(wd / "results")])
    return lines, ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--faults", nargs="+", default=FAULTS, choices=FAULTS)
    ap.add_argument("--tmpfs", default="8G", help="size of each workdir's own tmpfs (a real full disk)")
    ap.add_argument("--parallel", action="store_true", help="each fault in a workdir of its own, all at once")
    args = ap.parse_args()
    import torch
    import vllm

    if args.parallel and "oom_start" in args.faults:
        sys.exit("oom_start holds the whole GPU: run it without --parallel")
    model = build_target(Path(os.environ.get("TMPDIR", "/tmp")) / "e3p-gpu-target" / "model")
    print(f"# {torch.cuda.get_device_name(0)}, vLLM {vllm.__version__}, torch {torch.__version__}"
          + (", one workdir a fault, all at once" if args.parallel else ""))  # fmt: skip
    print("| fault | shard | rc | the job's one line | finished kept | processes left | GPU free after | rerun rc "
          "| rerun s | valid |\n|---|---|---|---|---|---|---|---|---|---|", flush=True)  # fmt: skip
    if args.parallel:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(args.faults)) as pool:
            done = list(pool.map(lambda f: run_rows(args.out / (OWN + f), model, [f], args.tmpfs, True), args.faults))
    else:
        done = [run_rows(args.out / "wd", model, args.faults, args.tmpfs, False)]
    print("\n".join(ln for lines, _ in done for ln in lines if not ln.startswith("|")))  # the rows came as they ran
    ok = all(good for _, good in done)
    print("GPU FAULT MATRIX:", "PASS" if ok else "FAIL")
    sys.exit(not ok)


if __name__ == "__main__":
    main()
