"""The `kill` scenario of bench/multi_gpu.py: SIGKILL to a running extract job's process group mid-shard,
then no process of it may live on or hold a GPU, and the same command must resume and validate."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from multigpu.checks import tqdm_percent
from multigpu.run import Run, finish, log_tail, start_snakemake
from multigpu.sampling import Sampler, host_gpu_count, host_summary
from multigpu.targets import prepare_inputs


def process_table(root_pid: int) -> list[dict]:
    import psutil

    rows = []
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(root_pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                rows.append(
                    {
                        "pid": p.pid,
                        "ppid": p.ppid(),
                        "pgid": os.getpgid(p.pid),
                        "created": p.create_time(),
                        "name": p.name(),
                        "cmdline": " ".join(p.cmdline())[:160],
                    }
                )
    return rows


def job_process(table: list[dict], log: Path) -> dict:
    """The extract job of `log`: the topmost process that writes to it (the job's script redirects its
    stderr there, and the engine processes it starts inherit it), not the shell that started it."""
    import psutil

    writers = []
    for r in table:
        with contextlib.suppress(psutil.Error):
            if any(Path(f.path) == log for f in psutil.Process(r["pid"]).open_files()):
                writers.append(r)
    pids = {r["pid"] for r in writers}
    top = [r for r in writers if r["ppid"] not in pids]
    if not top:
        raise SystemExit(f"kill: no process of the run has {log} open; processes: {table}")
    return top[0]


def alive(rows: list[dict]) -> list[dict]:
    """The processes of `rows` still running (same pid and start time; zombies do not count)."""
    import psutil

    out = []
    for r in rows:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(r["pid"])
            if abs(p.create_time() - r["created"]) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                out.append(r)
    return out


def unfinished_bytes(shard_dir: Path) -> int:
    """Bytes on disk in a shard's unfinished layer files (allocated blocks: the writer fills them by
    offset, so the size alone can run ahead of the data)."""
    total = 0
    for f in shard_dir.glob(".tmp-layer_*"):
        with contextlib.suppress(FileNotFoundError):  # renamed to its final name meanwhile
            total += f.stat().st_blocks * 512
    return total


def shm_segments() -> set[str]:
    """Shared-memory segments in /dev/shm (Python's psm_*, which vLLM's message queues use)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("psm_*")} if shm.is_dir() else set()


def compute_apps() -> list[dict] | None:
    """Processes holding GPU memory (nvidia-smi --query-compute-apps); None without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    out = subprocess.run(
        [smi, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return [
        dict(zip(("pid", "name", "used_mib"), (p.strip() for p in line.split(",")), strict=False))
        for line in out.splitlines()
        if line.strip()
    ]


def scenario_kill(args, lines: list[str]) -> None:
    """Extract + validate; SIGKILL the process group of an extract job mid-shard (after --finished-first
    shards have finished); check that nothing of it lives on or holds a GPU; run the same command again."""
    import psutil

    from eagle3prep.infra.gpus import GpuClaimError, claim_gpus

    model, sources = prepare_inputs(args)
    g = args.gpus[0]
    run = Run(args, "kill", g, args.tp)
    run.prepare(model, sources)
    run.tokenize()
    env, targets = run.env(), run.validation_targets()
    shm_before = shm_segments()
    proc = start_snakemake(run.wd, targets, g, env, "snakemake_killed.log")
    result: dict[str, Any] = {"run": run.name, "scenario": "kill", "gpus_resource": g, "tp_size": args.tp}
    victim = None
    deadline = time.time() + args.kill_timeout
    expected = run.layer_bytes()
    while proc.poll() is None and time.time() < deadline:
        done = [k for k in run.shards if (run.wd / f"results/hidden_states/shard_{k}/manifest.json").exists()]
        if len(done) >= args.finished_first:
            for k in run.shards:
                log = run.wd / f"logs/extract/shard_{k}.log"
                if k in done or not log.exists():
                    continue
                # How far the shard is: its progress bar (rows handed to the engine; printed at most once a
                # second) or the bytes its unfinished layer files hold on disk, whichever is further.
                pct = tqdm_percent(log.read_text(errors="replace")) or 0
                held = unfinished_bytes(run.wd / f"results/hidden_states/shard_{k}")
                full = expected.get(k) or 0
                part = max(pct / 100, held / full if full else 0.0)
                if part >= args.kill_at and held < 0.98 * full:  # past kill_at, its layer data not all written
                    victim = (k, round(100 * part))
                    break
        if victim:
            break
        time.sleep(0.1)
    if victim is None:
        proc.kill()
        finish(proc)
        raise SystemExit(
            f"kill: no extract job was seen between {args.kill_at:.0%} and 100% with {args.finished_first} shard(s) "
            f"finished before it (rc {proc.returncode}); use larger shards (--tokens-per-shard) or --finished-first 0\n"
            + log_tail(run.wd, "snakemake_killed.log")
        )
    k, pct = victim
    table = process_table(proc.pid)
    job = job_process(table, run.wd / f"logs/extract/shard_{k}.log")
    pgid = job["pgid"]
    done_before = {
        d.name: (d / "manifest.json").stat().st_mtime_ns
        for d in (run.wd / "results/hidden_states").glob("shard_*")
        if (d / "manifest.json").exists()
    }
    t_kill = time.time()
    os.killpg(pgid, signal.SIGKILL)
    # Jobs in Snakemake's group: the whole run died. In a group of their own: Snakemake sees the job fail
    # and, with the profile's keep-going, finishes the other shards first.
    finish(proc)
    # A process may take a moment to die and the driver a moment to free its memory. This bench holds
    # no CUDA context itself, so any compute app left on the host after the grace is a leak.
    grace_end = time.time() + args.grace
    while True:
        survivors, apps = alive(table), compute_apps()
        if (not survivors and not apps) or time.time() >= grace_end:
            break
        time.sleep(0.5)
    holding = [a for a in apps or [] if any(str(r["pid"]) == a["pid"] for r in table)]
    result.update(
        killed_shard=k,
        killed_at_percent=pct,
        job_pid=job["pid"],
        job_pgid=pgid,
        snakemake_pid=proc.pid,  # started in a session of its own: its pid is its process group
        whole_run_killed=pgid == proc.pid,
        processes_before_kill=table,
        survivors_after_grace=survivors,
        compute_apps_after_kill=apps,
        gpus_free_after_kill=None if apps is None else not apps,
        # vLLM's message queues live in /dev/shm; a killed engine cannot unlink its own (reported, kept).
        shm_segments_left=sorted(shm_segments() - shm_before),
        compute_apps_of_killed_tree=holding,
        grace_s=args.grace,
        seconds_to_checks=round(time.time() - t_kill, 1),
        shards_finished_before_kill=sorted(done_before),
        killed_shard_files=sorted(p.name for p in (run.wd / f"results/hidden_states/shard_{k}").glob("*")),
    )
    # The kernel drops a flock with its last holder: the GPU locks must all be free again.
    host = host_gpu_count(args)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # its "claimed GPU(s)" line is not the run's
            claim_gpus(host, lock_dir=env["EAGLE3PREP_GPU_LOCK_DIR"], num_gpus=host, wait_s=0).release()
        result["gpu_locks_free_after_kill"] = True
    except GpuClaimError as e:
        result["gpu_locks_free_after_kill"] = f"no: {e}"
    for r in survivors:  # ours to end, by pid, so the rerun below can claim the GPUs
        with contextlib.suppress(psutil.Error):
            os.kill(r["pid"], signal.SIGKILL)
    # The same command again, sampled like any run.
    t0 = time.time()
    proc2 = start_snakemake(run.wd, targets, g, env, "snakemake_rerun.log")
    sampler = Sampler(proc2.pid, every=args.sample_every)
    rc = finish(proc2)
    samples = sampler.stop()
    after = {
        d.name: (d / "manifest.json").stat().st_mtime_ns
        for d in (run.wd / "results/hidden_states").glob("shard_*")
        if (d / "manifest.json").exists()
    }
    result.update(
        rerun_rc=rc,
        rerun_wall_s=round(time.time() - t0, 1),
        finished_shards_untouched=all(after.get(n) == t for n, t in done_before.items()),
        validation_ok=run.validations(),
        jobs=run.jobs(),
        rerun_error=log_tail(run.wd, "snakemake_rerun.log") if rc else None,
    )
    result["all_validated"] = all(v is True for v in result["validation_ok"].values())
    result["host"] = host_summary(samples, None)
    if not args.keep_shards:
        shutil.rmtree(run.wd / "results/hidden_states", ignore_errors=True)
    (run.wd / "samples.json").write_text(json.dumps(samples))
    (run.wd / "run.json").write_text(json.dumps(result, indent=1))
    lines.append(f"\n### {run.name}: SIGKILL mid-shard, then the same command")
    lines.append(
        f"- killed: the process group {pgid} of shard {k}'s extract job (pid {job['pid']}) at {pct} % of the shard "
        f"({'the whole Snakemake run: jobs share its process group' if result['whole_run_killed'] else 'the job alone'}); "
        f"{len(table)} processes in the run's tree before the kill; shards finished before it: "
        f"{result['shards_finished_before_kill'] or 'none'}"
    )
    lines.append(
        f"- after {result['seconds_to_checks']} s: processes of the killed tree still alive: "
        f"{[(r['pid'], r['name']) for r in survivors] or 'none'}; "
        + (
            "nvidia-smi absent (CPU run): compute apps not checked"
            if apps is None
            else f"GPU compute apps on the host: {apps or 'none'} (of the killed tree by pid: {holding or 'none'})"
        )
        + f"; GPU locks free: {result['gpu_locks_free_after_kill']}; /dev/shm psm_* segments new since the run began "
        f"(any process's): {result['shm_segments_left'] or 'none'}"
    )
    lines.append(f"- files left in the killed shard's folder: {result['killed_shard_files']}")
    lines.append(
        f"- rerun: rc {rc} in {result['rerun_wall_s']} s; finished shards untouched: "
        f"{result['finished_shards_untouched']}; every shard validated ok: {result['all_validated']} "
        f"{result['validation_ok']}"
    )
    if rc:
        lines.append(f"```\n{result['rerun_error']}\n```")
