"""The plain scenarios of bench/multi_gpu.py: `jobs` (the same shards at each --gpus value, then the
comparison), `tp` (one TP-N job at a time) and `build` (the target alone)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from multigpu.report import compare, flush, print_run
from multigpu.run import Run, measure_run
from multigpu.targets import build_model, model_folder, prepare_inputs


def disk_probe(args) -> float | None:
    """The disk's own write + fsync speed where the shards go, as many files at once as the run writes."""
    if not args.disk_probe_gb:
        return None
    from extractbench.disk import disk_write_speed

    where = Path(args.results_on) if args.results_on else args.out
    streams = 4 * max(1, max(args.gpus) // args.tp)  # four layer files per job
    return disk_write_speed(where, int(args.disk_probe_gb * 2**30), streams=streams)


def scenario_jobs(args, lines: list[str]) -> None:
    """The same shards at each --gpus value (descending), tp_size --tp; then the comparison."""
    model, sources = prepare_inputs(args)
    disk_bps = disk_probe(args)
    if disk_bps:
        lines.append(f"disk write + fsync where the shards go: {disk_bps / 1e9:.2f} GB/s")
    for g in sorted(args.gpus, reverse=True):
        run = Run(args, "jobs", g, args.tp)
        run.prepare(model, sources)
        shards = run.shards[: args.baseline_shards] if g == 1 and args.baseline_shards else None
        r = measure_run(run, shards)
        r["scenario"], r["disk_probe_bps"] = "jobs", disk_bps
        (run.wd / "run.json").write_text(json.dumps(r, indent=1))
        print_run(r, lines)
        flush(lines)
    compare(args.out, Run(args, "jobs", 1, args.tp).config_key, lines, disk_bps)


def scenario_tp(args, lines: list[str]) -> None:
    """tp_size --tp with gpus=G: expect G // tp jobs at once, each on tp distinct GPUs."""
    model, sources = prepare_inputs(args)
    g = args.gpus[0]
    run = Run(args, "tp", g, args.tp)
    run.prepare(model, sources)
    r = measure_run(run)
    expected = max(1, g // args.tp)
    r["scenario"], r["expected_concurrent_jobs"] = "tp", expected
    r["jobs_with_wrong_gpu_count"] = [j["shard"] for j in r["jobs"] if len(set(j["gpus"])) != args.tp]
    (run.wd / "run.json").write_text(json.dumps(r, indent=1))
    print_run(r, lines)
    lines.append(
        f"- tp_size {args.tp} with gpus={g}: expected at most {expected} job(s) at once, saw {r['max_concurrent_jobs']}; "
        f"jobs not on {args.tp} distinct GPUs: {r['jobs_with_wrong_gpu_count'] or 'none'}"
    )


def scenario_build(args, lines: list[str]) -> None:
    """The target alone (a device command of its own when building it and running a scenario do not
    fit one call): later scenarios with the same OUT, --target and --layers reuse it."""
    t0 = time.time()
    folder = build_model(args.target, model_folder(args), args.layers, args.device)
    size = sum(f.stat().st_size for f in folder.iterdir())
    lines.append(f"built {folder} ({size / 1e9:.1f} GB) in {time.time() - t0:.0f} s")
