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
    out_json = args.out / "moe_prefill.json"
    if args.render:  # the table again from an earlier run's raw results, no engine
        lines.extend(moe_table(json.loads(out_json.read_text()), args.seq, (args.min_len + args.max_len) / 2))
        return
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
    data = {"config": cfg, "tp": args.tp, "results": results}
    out_json.write_text(json.dumps(data, indent=1))
    lines.extend(moe_table(data, args.seq, (args.min_len + args.max_len) / 2))


def moe_flops_per_token(cfg: dict, seq: float) -> float:
    """Prefill FLOPs per token of a DeepSeek-V3-shaped model, counting active parameters only: 2 x (MLA
    projections + the dense MLP or the shared and top-k routed experts + the router) per layer, plus causal
    attention over MLA's head dims (seq x heads x (qk + v) per layer); embeddings and lm_head left out, as
    bench_extract's dense count does."""
    h, heads, n = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    attn = (
        h * cfg["q_lora_rank"]
        + cfg["q_lora_rank"] * heads * qk
        + h * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
        + cfg["kv_lora_rank"] * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
        + heads * cfg["v_head_dim"] * h
    )
    dense = cfg.get("first_k_dense_replace", 0)
    experts = cfg["num_experts_per_tok"] + cfg.get("n_shared_experts", 0)
    mlp = dense * 3 * h * cfg["intermediate_size"] + (n - dense) * (
        3 * h * cfg["moe_intermediate_size"] * experts + h * cfg["n_routed_experts"]
    )
    return 2 * (n * attn + mlp) + n * seq * heads * (qk + cfg["v_head_dim"])


def moe_table(data: dict, seq: float, mixed_seq: float) -> list[str]:
    """The moe-prefill report: tokens/s, ratios to (a), MFU on active parameters and bytes/s per phase."""
    from extractbench.workload import PEAK_TFLOPS, layer_ids

    cfg, tp, results = data["config"], data["tp"], data["results"]
    a, b, f = results.get("a", {}), results.get("b", {}), results.get("f", {})

    def mfu(rate: float | None, w: str) -> str:
        flops = moe_flops_per_token(cfg, mixed_seq if w == "mixed" else seq)
        return f"{100 * rate * flops / 1e12 / (PEAK_TFLOPS * tp):.0f} %" if rate else "-"

    lines = [
        f"\n### moe-prefill: {cfg['architectures'][0]} hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers "
        f"({cfg.get('first_k_dense_replace')} dense), {cfg['n_routed_experts']} experts x {cfg['moe_intermediate_size']}, "
        f"top {cfg['num_experts_per_tok']}; TP {tp}, random weights (load_format dummy), layers {layer_ids(cfg)}",
        "| workload | (a) vLLM prefill tok/s | MFU | (b) eagle3prep vllm tok/s | b/a | (b) capture path | (b) bytes/s "
        "| (f) built-in, compiled tok/s | f/a | (f) bytes/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in ("uniform", "mixed", "uniform_shm"):
        ra = a.get(w.removesuffix("_shm"), {}).get("tokens_per_s")
        rb, rf = b.get(w, {}).get("tokens_per_s"), f.get(w, {}).get("tokens_per_s")
        lines.append(
            f"| {w} | {fmt(ra)} | {mfu(ra, w)} | {fmt(rb)} | {ratio(rb, ra)} | {b.get('capture_path', '-')} | "
            f"{fmt(b.get(w, {}).get('bytes_per_s'))} | {fmt(rf)} | {ratio(rf, ra)} | {fmt(f.get(w, {}).get('bytes_per_s'))} |"
        )
    lines.append(
        f"- MFU: active parameters (dense MLP or {cfg['num_experts_per_tok']} routed + shared experts, MLA, router) "
        f"and causal attention at {seq:.0f} tokens (mixed: {mixed_seq:.0f}), of {PEAK_TFLOPS:.0f} TFLOP/s a GPU x {tp}; "
        f"b and f at the same rate have a's MFU times b/a or f/a"
    )
    if a and b.get("uniform", {}).get("tokens"):
        per_token = b["uniform"]["bytes"] / b["uniform"]["tokens"]
        lines.append(
            f"- hidden states: {per_token:,.0f} B a token; at (a)'s uniform rate the shard needs "
            f"{a['uniform']['tokens_per_s'] * per_token / 1e9:.2f} GB/s; this model computes "
            f"{moe_flops_per_token(cfg, seq) / 1e9:.1f} GFLOP a token (uniform)"
        )
    for p, r in (("b", b), ("f", f)):
        if r:
            lines.append(
                f"- ({p}) engine start {r['engine_start_s']:.1f} s, peak RSS of the capture processes "
                f"{r['peak_rss_mib']:.0f} MiB, vLLM {r.get('vllm')}, capture path {r.get('capture_path')}; "
                f"writer, uniform: {r.get('uniform', {}).get('writer')}"
            )
    if a:
        lines.append(f"- (a) engine start {a.get('engine_start_s', float('nan')):.1f} s")
    return lines


def ratio(x: float | None, y: float | None) -> str:
    return f"{x / y:.2f}" if x and y else "-"


def phase_namespace(args, cfg: dict) -> argparse.Namespace:
    """bench_extract's arguments for one moe-prefill phase (text rows of synthetic token ids)."""
    return argparse.Namespace(
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
        image_threads=0,  # phase_b reads it (the pool of image rows' requests): the code's
    )


def moe_phase(args) -> None:
    """One bench_extract phase, with bench_extract's own argument names, at tensor parallel --tp."""
    from extractbench import phases, workload

    folder = args.out / f"moe-model-l{args.layers}"
    cfg = json.loads((folder / "config.json").read_text())
    ns = phase_namespace(args, cfg)
    ns.out.mkdir(parents=True, exist_ok=True)
    work = workload.workloads(ns)  # token ids below the vocabulary of either shape
    phase = {"a": phases.phase_a, "b": phases.phase_b, "f": phases.phase_f}[args.phase]
    print("RESULT " + json.dumps(phase(ns, folder, work)), flush=True)
