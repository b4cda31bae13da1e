"""The seed sweep: does validation pass every correct capture, and fail every planted mistake, on many seeds?

    python bench/seed_sweep.py OUT [--variants ...] [--seeds 0 1 2 3 4] [--backends hf vllm]
                                   [--dtypes float32 bfloat16] [--rows 6] [--shards 2]
    python bench/seed_sweep.py - --summarize RUN/sweep.json ...

The validation matrix's cells (bench/validation_matrix.run_cell: capture ids 1..N of `--shards` shards,
validate every row, then each planted mistake) for each variant and seed: the model's weights and the
rows are both drawn from the seed. Variants are tiny_models families, plus `deepseek_v3_g2`: the
DeepSeek-V3 shape of issue 24 (8 routed experts, top-2 of 1 of 2 groups, layers 2-5 MoE, experts at
the other weights' 0.1), whose re-routed tokens move ~0.5. For fp32 MoE cells it also measures how far
the capture's router input moves a router margin (`margin_moved`, in fp32 epsilons of the chosen score):
the reference's MoE layer l is fed the captured id l, and its top-k gap compared with the reference's own
(passrule.TIE_FACTOR is set from it). Prints a markdown table, writes OUT/sweep.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

from eagle3prep.testing.tiny_models import FAMILIES, build_family
from eagle3prep.validate.reference import ReferencePair

HERE = Path(__file__).resolve().parent
FP32_EPS = 2.0**-23
# A captured router input further than this from the reference's was re-routed earlier (or follows such a
# token in a cascade): not rounding. fp32 captures of clean tokens are at ~1e-5.
CLEAN = 1e-3
# (tiny_models family, config overrides, expert_scale) per variant.
VARIANTS = {name: (name, None, 1.0) for name in FAMILIES}
VARIANTS["deepseek_v3_g2"] = ("deepseek_v3", dict(n_group=2, topk_group=1, first_k_dense_replace=2), 2.5)


def load_matrix():
    spec = importlib.util.spec_from_file_location("validation_matrix", HERE / "validation_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_variant(variant: str, out: Path, seed: int) -> Path:
    family, overrides, expert_scale = VARIANTS[variant]
    return build_family(family, out, seed=seed, overrides=overrides, expert_scale=expert_scale)


def margin_moves(model, input_ids: list[int], captured: dict[int, object]) -> list[float]:
    """Per MoE layer l and token: |gap(captured id l) - gap(reference)| / (eps * |k-th score|), the top-k gap
    of the reference's choice, on the tokens before the row's first one off by over CLEAN at any captured id."""
    import torch

    from eagle3prep.validate.passrule import token_errors
    from eagle3prep.validate.routing import ranked, routers

    gates, base, seen = routers(model), model.get_decoder(), {}
    ids = torch.tensor([input_ids])

    def run(layer: int | None):
        hooks = [g.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[0])) for i, g in gates.items()]
        if layer is not None:  # the captured id `layer` in place of the reference's own input of that layer

            def swap(module, args, kwargs):
                x = captured[layer].to(args[0].dtype if args else kwargs["hidden_states"].dtype).unsqueeze(0)
                return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

            hooks.append(base.layers[layer].register_forward_pre_hook(swap, with_kwargs=True))
        try:
            with torch.inference_mode():
                out = model(ids, output_hidden_states=True, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        return dict(seen), out.hidden_states

    ref_logits, ref_states = run(None)
    # Rounding alone: tokens before the row's first re-route (attention carries one to every later token).
    onset = len(input_ids)
    for lid, x in captured.items():
        if lid >= len(ref_states) - 1:  # hidden_states[N] is after the final norm, captured id N before it
            continue
        off = torch.nonzero(token_errors(x, ref_states[lid][0]) > CLEAN)
        onset = min(onset, int(off[0]) if len(off) else onset)
    moves = []
    for layer, gate in gates.items():
        if layer not in captured:  # id 0 (Qwen-MoE's layer 0 input) is not captured: the embedding, exact
            continue
        logits, _ = run(layer)
        s_ref, s_cap = ranked(gate, ref_logits[layer])[0], ranked(gate, logits[layer])[0]
        order = s_ref.topk(gate.top_k + 1, dim=-1)[1]  # the reference's k-th choice and runner-up
        a, b = order[:, -2:-1], order[:, -1:]
        gap_ref = (s_ref.gather(1, a) - s_ref.gather(1, b)).squeeze(1)
        gap_cap = (s_cap.gather(1, a) - s_cap.gather(1, b)).squeeze(1)
        move = (gap_cap - gap_ref).abs() / (FP32_EPS * s_ref.gather(1, a).squeeze(1).abs())
        moves.extend(move[:onset].tolist())
    return moves


def measure_moves(shards: list[Path], tokens: list[Path], refs: ReferencePair) -> dict:
    """margin_moves over every row of the captured shards: max and quantiles, in fp32 epsilons."""
    import torch

    from eagle3prep.shard.layout import layer_file
    from eagle3prep.shard.manifest import read_manifest
    from eagle3prep.shard.readers import read_index, read_layer

    moves: list[float] = []
    for shard, tok in zip(shards, tokens, strict=True):
        rows = [json.loads(line) for line in tok.read_text(encoding="utf-8").splitlines()]
        lids = read_manifest(shard).layer_ids
        for e, row in zip(read_index(shard), rows, strict=True):
            got = {
                lid: read_layer(shard / layer_file(lid), e.offset, e.offset + e.length, torch.float32) for lid in lids
            }
            moves.extend(margin_moves(refs.exact.model, row["input_ids"], got))
    m = torch.tensor(moves)
    q = torch.quantile(m, torch.tensor([0.5, 0.99, 0.999])).tolist() if len(m) else [0, 0, 0]
    return {"tokens": len(moves), "max": float(m.max()) if len(m) else 0.0, "p50": q[0], "p99": q[1], "p999": q[2]}


def divergent_rows(shards: list[Path], tokens: list[Path], refs: ReferencePair, dtype: str) -> list[dict]:
    """Every (row, layer) of the correct captures with a diverged token: where it starts, how far, its margin."""
    import torch

    from eagle3prep.shard.layout import layer_file
    from eagle3prep.shard.manifest import read_manifest
    from eagle3prep.shard.readers import read_index, read_layer
    from eagle3prep.validate.passrule import judge_row

    out = []
    for shard, tok in zip(shards, tokens, strict=True):
        rows = [json.loads(line) for line in tok.read_text(encoding="utf-8").splitlines()]
        lids = read_manifest(shard).layer_ids
        for e, row in zip(read_index(shard), rows, strict=True):
            ref, floor = refs.rows(row["input_ids"], lids)
            for lid in lids:
                got = read_layer(shard / layer_file(lid), e.offset, e.offset + e.length, torch.float32)
                margins = refs.margins(row["input_ids"], lid)
                r = judge_row(got, ref[lid], floor[lid] if floor else None, dtype, margins=margins)
                if r["diverged"]:
                    keep = ("diverged", "floor_diverged", "cascade", "tie", "margin_at_first", "worst_pos", "ok")
                    out.append({"row": e.row, "layer": lid, **{k: r[k] for k in keep}, "error": r["worst_pos_rel"]})
    return out


def sweep_cell(matrix, args, variant: str, seed: int, model: Path, dtype: str, backend: str, tokens, refs) -> dict:
    """One matrix cell (validation_matrix.run_cell) on this seed's model and rows, plus margin moves in fp32."""
    cell = matrix.run_cell(args, variant, model, backend, dtype, tokens, refs)
    cell.update(seed=seed, variant=variant)
    wd = args.out / "cells" / f"{variant}-{backend}-{dtype}"
    shards = [wd / f"shard_{k}" for k in range(len(tokens))]
    cell["divergent_rows"] = divergent_rows(shards, tokens, refs, dtype)
    if dtype == "float32" and refs.exact.router_margins.layers:
        cell["margin_moved"] = measure_moves(shards, tokens, refs)
    return cell


def summary_row(c: dict) -> str:
    head = f"| {c['variant']} | {c['seed']} | {c['backend']} | {c['dtype']} |"
    if "error" in c:
        return f"{head} refused: {c['error'][:300]} | | | | |"
    layers = [x for v in c["correct"] if v["layers"] for x in v["layers"].values()]
    worst = max((x["worst_margin"] for x in layers), default=0)
    cascades = sum(x.get("cascade_rows", 0) for x in layers)
    ties = sum(x.get("tie_rows", 0) for x in layers)
    rows = sum(v["rows"] or 0 for v in c["correct"])
    missed = [m for m, p in c["planted"].items() if not p["caught"]]
    caught = f"{len(c['planted']) - len(missed)}/{len(c['planted'])}" + (
        f" missed: {', '.join(missed)}" if missed else ""
    )
    moved = c.get("margin_moved")
    moved = f"{moved['max']:.0f} (p99 {moved['p99']:.1f})" if moved else "-"
    fails = "; ".join(v["message"][-200:] for v in c["correct"] if not v["ok"])
    verdict = "PASS" if c["correct_ok"] else f"FAIL {fails}"
    return f"{head} {verdict} ({rows} rows) | {worst:.2f} | {cascades} / {ties} | {moved} | {caught} |"


def summarize(paths: list[Path]) -> None:
    """One line per variant, backend and dtype over every seed of the sweep.json files given."""
    cells = [c for p in paths for c in json.loads(p.read_text())]
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["variant"], c["backend"], c["dtype"]), []).append(c)
    print(
        "| variant | backend | dtype | seeds | correct capture passes | planted caught | near-tie cascades (row x layer) | margin moved, max eps |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (variant, backend, dtype), group in sorted(groups.items()):
        ok = [c for c in group if "error" not in c]
        passed = sum(c["correct_ok"] for c in ok)
        planted = [(m, c["seed"]) for c in ok for m, p in c["planted"].items() if not p["caught"]]
        caught = sum(len(c["planted"]) for c in ok) - len(planted)
        ties = sum(r["tie"] for c in ok for r in c.get("divergent_rows", []))
        moved = max((c["margin_moved"]["max"] for c in ok if "margin_moved" in c), default=None)
        missed = f" (missed: {', '.join(f'{m} seed {s}' for m, s in planted)})" if planted else ""
        print(
            f"| {variant} | {backend} | {dtype} | {sorted(c['seed'] for c in group)} | {passed}/{len(group)} | "
            f"{caught}/{caught + len(planted)}{missed} | {ties} | {'-' if moved is None else f'{moved:.0f}'} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=6, help="rows per shard (every row is validated)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--summarize", nargs="+", type=Path, help="sweep.json files: print one table over them")
    args = ap.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    args.out.mkdir(parents=True, exist_ok=True)
    args.device, args.tp, args.dump, args.storage = "cpu", 1, False, "model_dtype"
    matrix = load_matrix()
    table = open(args.out / "table.md", "a", encoding="utf-8")  # noqa: SIM115 - vLLM logs to stdout too

    def emit(line: str) -> None:
        print(line, flush=True)
        table.write(line + "\n")
        table.flush()

    emit(f"# {time.strftime('%Y-%m-%d %H:%M')} seed sweep, {args.rows} rows x {args.shards} shards per cell")
    emit(
        "| variant | seed | backend | dtype | correct capture, every row | worst error / bound "
        "| cascade rows / at a near-tie | margin moved, eps (max) | planted caught |"
    )
    emit("|---|---|---|---|---|---|---|---|---|")
    cells = []
    for variant in args.variants:
        for seed in args.seeds:
            model = build_variant(variant, args.out / "models" / f"{variant}-{seed}", seed)
            vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 512)
            tokens = [
                matrix.write_rows(
                    args.out / f"tokens_{variant}_{seed}_{k}.jsonl", args.rows, vocab, 1000 * seed + k, k * args.rows
                )
                for k in range(args.shards)
            ]
            for dtype in args.dtypes:
                refs = ReferencePair(str(model), dtype, "cpu", cache_rows=args.rows * args.shards)
                for backend in args.backends:
                    t0 = time.time()
                    try:
                        cell = sweep_cell(matrix, args, variant, seed, model, dtype, backend, tokens, refs)
                    except Exception as e:  # one broken cell must not hide the others
                        traceback.print_exc(file=sys.stderr)
                        cell = {
                            "variant": variant,
                            "seed": seed,
                            "backend": backend,
                            "dtype": dtype,
                            "error": f"{type(e).__name__}: {e}",
                        }
                    cell["seconds"] = time.time() - t0
                    cells.append(cell)
                    emit(summary_row(cell))
                    (args.out / "sweep.json").write_text(json.dumps(cells, indent=1))


if __name__ == "__main__":
    main()
