"""The `moe-prefill` scenario of bench/multi_gpu.py: bench_extract's phases (a) plain vLLM prefill, (b)
our vllm backend (--capture-path) and (f) its built-in path compiled, each in its own process at --tp,
on a DeepSeek-V3-shaped MoE with random weights."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from multigpu import SCRIPT
from multigpu.report import fmt


def scenario_moe_prefill(args, lines: list[str]) -> None:
    """bench_extract's phases (a) and (b), each in its own process, on a DeepSeek-V3-shaped config (dummy weights)."""
    from extractbench.workload import layer_ids

    folder = args.out / f"moe-model-l{args.layers}"
    if args.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the phases' processes inherit it
    if not (folder / "config.json").exists():
        subprocess.run(
            [
                sys.executable,
                str(SCRIPT),
                "_moe_config",
                str(folder),
                "--layers",
                str(args.layers),
                "--device",
                args.device,
            ],
            check=True,
        )
    results = {}
    for phase in args.phases:
        cmd = [sys.executable, str(SCRIPT), *sys.argv[1:], "--phase", phase]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not got:
            lines.append(f"phase {phase} failed (rc {proc.returncode}):\n```\n{proc.stderr[-4000:]}\n```")
            continue
        results[phase] = json.loads(got[-1][7:])
        results[phase]["wall_s"] = round(time.time() - t0, 1)
    cfg = json.loads((folder / "config.json").read_text())
    (args.out / "moe_prefill.json").write_text(
        json.dumps({"config": cfg, "tp": args.tp, "results": results}, indent=1)
    )
    ids = layer_ids(cfg)
    lines.append(
        f"\n### moe-prefill: {cfg['architectures'][0]} hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers "
        f"({cfg.get('first_k_dense_replace')} dense), {cfg['n_routed_experts']} experts x {cfg['moe_intermediate_size']}, "
        f"top {cfg['num_experts_per_tok']}; TP {args.tp}, random weights (load_format dummy), layers {ids}"
    )
    lines.append(
        "| workload | (a) vLLM prefill tok/s | (b) eagle3prep vllm tok/s | b/a | (b) capture path "
        "| (f) built-in, compiled tok/s | f/a | (f) bytes/s |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    a, b, f = results.get("a", {}), results.get("b", {}), results.get("f", {})
    for w in ("uniform", "mixed", "uniform_shm"):
        ra = a.get(w.removesuffix("_shm"), {}).get("tokens_per_s")
        rb, rf = b.get(w, {}).get("tokens_per_s"), f.get(w, {}).get("tokens_per_s")
        lines.append(
            f"| {w} | {fmt(ra)} | {fmt(rb)} | {ratio(rb, ra)} | {b.get('capture_path', '-')} | {fmt(rf)} | "
            f"{ratio(rf, ra)} | {fmt(f.get(w, {}).get('bytes_per_s'))} |"
        )
    if b:
        lines.append(
            f"- (b) engine start {b['engine_start_s']:.1f} s, peak RSS of the capture processes {b['peak_rss_mib']:.0f} MiB, "
            f"vLLM {b.get('vllm')}; (a) engine start {a.get('engine_start_s', float('nan')):.1f} s"
        )


def ratio(x: float | None, y: float | None) -> str:
    return f"{x / y:.2f}" if x and y else "-"


def moe_phase(args) -> None:
    """One bench_extract phase, with bench_extract's own argument names, at tensor parallel --tp."""
    from extractbench import phases, workload

    folder = args.out / f"moe-model-l{args.layers}"
    cfg = json.loads((folder / "config.json").read_text())
    ns = argparse.Namespace(
        out=args.out / f"moe-phase-{args.phase}",
        tiny=args.device == "cpu",
        device=args.device,
        rows=args.rows,
        seq=args.seq,
        min_len=args.min_len,
        max_len=args.max_len,
        dtype="bfloat16",
        capture_path=args.capture_path,
        batched_tokens=args.batched_tokens,
        batch_tokens=args.batch_tokens,
        gpu_mem=args.gpu_mem,
        shape=cfg,
        tp=args.tp,
        images=0,  # text rows: the image-heavy workload is bench_extract --images
        vision=None,
    )
    ns.out.mkdir(parents=True, exist_ok=True)
    work = workload.workloads(ns)  # token ids below the vocabulary of either shape
    phase = {"a": phases.phase_a, "b": phases.phase_b, "f": phases.phase_f}[args.phase]
    print("RESULT " + json.dumps(phase(ns, folder, work)), flush=True)
