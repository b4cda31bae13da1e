"""The validation matrix's cell (bench/validation_matrix.py runs it on every family, backend and dtype; the tests
run it in small): capture every id 1..N of a few shards of synthetic rows with one engine, validate every row, then
validate each planted mistake of testkit.planted, which must fail.

Families are tiny_models', `kimi_int4` (tiny_kimi: INT4 routed experts, recomputed from its bf16 twin) and
`qwen2_5_vl` (tiny_vl, on conversations with images, which also plants the IMAGE_MISTAKES). VARIANTS adds
`deepseek_v3_g2`, a DeepSeek-V3 shape whose re-routed tokens move ~0.5 (8 routed experts, top-2 of 1 of 2
groups, layers 2-5 MoE, experts at the other weights' 0.1): the shape of the router near-tie tests.

With a logprob window (`args.logprob_window`, bench's `--logprob-window N`) the vLLM driver asks for the prompt
logprobs of every row, and a row longer than N through a prefix request of its first N tokens (vllm/capture/
requests.logprob_request), as a row over vllm/memory.LOGPROB_WINDOW (2,048) is on a GPU. Each shard, right
and planted, is then also validated with `validate.reference: scalable`, whose logits check covers those prefixes.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path

from eagle3prep.extract import extract_shard
from eagle3prep.extract.backend import make_backend
from eagle3prep.layers import default_layer_ids
from eagle3prep.settings import ExtractSettings
from eagle3prep.shard.tokenized import rows as tokenized_rows
from eagle3prep.validate import ValidationError, validate_shard
from eagle3prep.validate.reference import ReferencePair

from testkit.planted import IMAGE_MISTAKES, MISTAKES, plant, plant_image
from testkit.shards import capture_spec, with_settings
from testkit.tiny_models import FAMILIES, build_family

SEED = 0
KIMI = "kimi_int4"  # the tiny Kimi-K2.5-shaped target, routed experts INT4 (testkit.tiny_kimi)
VL = "qwen2_5_vl"  # the tiny Qwen2.5-VL (testkit.tiny_vl), on conversations with images
# The image family's image sizes: 4, 6, 12, 24 and 48 vision tokens (one per 28 x 28 pixels)
VL_SIZES = [(56, 56), (84, 56), (112, 84), (168, 112), (224, 168)]


# (tiny_models family, config overrides, expert_scale) per variant of build_variant
VARIANTS = {name: (name, None, 1.0) for name in FAMILIES}
VARIANTS["deepseek_v3_g2"] = ("deepseek_v3", dict(n_group=2, topk_group=1, first_k_dense_replace=2), 2.5)


def build_variant(variant: str, out: Path, seed: int) -> Path:
    """A tiny random target of VARIANTS, its weights drawn from `seed`."""
    family, overrides, expert_scale = VARIANTS[variant]
    return build_family(family, out, seed=seed, overrides=overrides, expert_scale=expert_scale)


def build_model(family: str, folder: Path) -> Path:
    if family == KIMI:
        from testkit.tiny_kimi import build_variants

        if not (folder / "config.json").exists():
            build_variants({"int4": folder, "bf16": reference_model(family, folder)})
        return folder
    if family == VL:
        from testkit.tiny_vl import build_tiny_vl

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
    from testkit.image_rows import matrix_records, tokenize_records

    root = out / f"rows_{VL}"
    return tokenize_records(matrix_records(root, rows, shards, VL_SIZES, SEED), model, root, 256, shards)


def validate(shard: Path, tokens: Path, model: Path, refs: ReferencePair, out: Path, reference=True) -> dict:
    """validate_shard on every row; {'ok', 'failed': [check names], 'message', 'report'}."""
    try:
        report = validate_shard(
            str(shard), str(tokens), str(out), str(model), sample_rows=10**9, device=refs.exact.device,
            reference=reference, refs=refs, seed=0, trust_remote_code=False, windows=None,
        )  # fmt: skip
        return {"ok": True, "failed": [], "message": "", "report": report}
    except ValidationError as e:
        return {"ok": False, "failed": e.failed, "message": str(e), "report": None}


# The planted mistakes that change what id N holds beyond a scale: the logits check alone must fail them
# (layer_plus_one leaves id N alone; the final RMSNorm hides `scaled`, and post_norm_final where its weight is 1).
LOGITS_VISIBLE = ("layer_minus_one", "rows_swapped", "tokens_shifted", "other_shard")


@contextlib.contextmanager
def logprob_window(window: int | None):
    """The vLLM driver's logprob window set to `window` tokens for the block (None: left as it is).

    requests.py imported LOGPROB_WINDOW by name and logprob_request reads that name at call time, in the process
    that adds the requests (the one holding the LLM, this one), so paths' own name is the one to set;
    memory's too, which the driver's memory plan reads."""
    if window is None:
        yield
        return
    from eagle3prep.vllm import memory
    from eagle3prep.vllm.capture import requests as paths

    old = paths.LOGPROB_WINDOW, memory.LOGPROB_WINDOW
    paths.LOGPROB_WINDOW = memory.LOGPROB_WINDOW = window
    try:
        yield
    finally:
        paths.LOGPROB_WINDOW, memory.LOGPROB_WINDOW = old


def logprob_notes(shard: Path) -> list[str]:
    """The driver's notes of logits-check rows it covered in part (timings.json's writer stats)."""
    return json.loads((shard / "timings.json").read_text()).get("writer", {}).get("logprob_notes", [])


def run_cell(
    args, family: str, model: Path, backend: str, dtype: str, tokens: list[Path], refs, seed: int = 0
) -> dict:
    """Capture the shards with one engine, validate them, then validate each planted mistake."""
    n = refs.n
    storage = getattr(args, "storage", "model_dtype")
    window = getattr(args, "logprob_window", None)
    cell = {"family": family, "backend": backend, "dtype": dtype, "device": args.device, "tp": args.tp}
    cell["storage"] = storage
    if seed:
        cell["seed"] = seed
    wd = args.out / "cells" / (f"{family}-{backend}-{dtype}" + (f"-s{seed}" if seed else ""))
    lengths = [[len(r["input_ids"]) for r in tokenized_rows(t)] for t in tokens]
    spec = capture_spec(
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
        # a window: every row's logprobs (the logits check on every row), else the default rows of the shard
        **({"logprob_rows": max(map(len, lengths))} if window else {}),
    )
    t0 = time.time()
    engine = make_backend(with_settings(spec, settings))
    try:
        with logprob_window(window):
            info = engine.probe()
            shards = []
            for k, tok in enumerate(tokens):
                shard = wd / f"shard_{k}"
                extract_shard(str(tok), str(shard), with_settings(spec, settings), shard=k, engine=(engine, info))
                shards.append(shard)
    finally:
        engine.close()
    if window and backend == "vllm":  # the window took effect: one note per row over it, no more
        notes = [logprob_notes(s) for s in shards]
        over = [sum(x > window for x in ls) for ls in lengths]
        assert list(map(len, notes)) == over, f"logprob notes {list(map(len, notes))}, rows over {window}: {over}"
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
    if window:
        pairs = enumerate(zip(shards, tokens, strict=True))
        cell["logits"] = logits_summary(
            [validate(s, t, model, refs, wd / f"s_{k}.json", "scalable") for k, (s, t) in pairs]
        )
        cell["logits"]["window"] = window
    cell["planted"] = {}
    for mistake in MISTAKES:
        bad = plant(mistake, shards[0], wd / f"planted_{mistake}", claimed, final_norm, scale, other=shards[1])
        v = validate(bad, tokens[0], model, refs, wd / f"v_{mistake}.json")
        cell["planted"][mistake] = {"caught": not v["ok"], "failed": v["failed"], "message": v["message"][:400]}
        if window:
            v = validate(bad, tokens[0], model, refs, wd / f"s_{mistake}.json", "scalable")
            cell["planted"][mistake].update(scalable_caught=not v["ok"], logits_failed="logits" in v["failed"])
    if family == VL:  # the ways a capture feeds images wrong: image rows recomputed with the wrong images
        for mistake in IMAGE_MISTAKES:
            bad = plant_image(mistake, shards[0], wd / f"planted_{mistake}", tokens[0], str(model))
            v = validate(bad, tokens[0], model, refs, wd / f"v_{mistake}.json")
            cell["planted"][mistake] = {"caught": not v["ok"], "failed": v["failed"], "message": v["message"][:400]}
    return cell


def logits_summary(results: list[dict]) -> dict:
    """The scalable validations of a cell's right shards: did they pass, on how many rows the logits check ran and
    on how many only through the prefix."""
    verdicts = [x for v in results if v["report"] for x in v["report"]["scalable"]["logits"]]
    return {
        "ok": all(v["ok"] for v in results),
        "message": "; ".join(v["message"][:300] for v in results if not v["ok"]),
        "rows": len(verdicts),
        "prefix_rows": sum(x["covered_tokens"] < x["row_tokens"] for x in verdicts),
    }


def dump_tokens(path: Path, shards: list[Path], tokens: list[Path], refs: ReferencePair, model: Path) -> None:
    """Per row and layer, every token's relative error of the capture and of the floor run (for calibration)."""
    import numpy as np
    import torch

    from eagle3prep.shard.layout import layer_file
    from eagle3prep.shard.manifest import read_manifest
    from eagle3prep.shard.readers import read_index, read_layer
    from eagle3prep.tokenize.row_inputs import RowImages

    out = {}
    for shard, tok in zip(shards, tokens, strict=True):
        rows = list(tokenized_rows(tok))
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
    family = c["family"] + (f", seed {c['seed']}" if "seed" in c else "")
    return (
        f"| {family} | {c['backend']} ({c['capture_path']}) | {c['dtype']} | {c['device']} | {c['tp']} | "
        f"{'PASS' if c['correct_ok'] else 'FAIL'} ({rows} rows) | {worst:.2f} | {div:.2%} / {fdiv:.2%} | {cascades} | "
        f"{len(caught)}/{len(c['planted'])}{' missed: ' + ', '.join(missed) if missed else ''} |"
        + (logits_cell(c) if "logits" in c else "")
    )


def logits_cell(c: dict) -> str:
    """The window columns: the scalable validation of the right shards (logits-check rows, how many through the
    prefix), and of the planted ones (caught; failed by the logits check itself)."""
    lg, planted = c["logits"], c["planted"]
    missed = [m for m, p in planted.items() if not p["scalable_caught"]]
    by_logits = [m for m, p in planted.items() if p["logits_failed"]]
    unseen = [m for m in LOGITS_VISIBLE if m in planted and m not in by_logits]
    return (
        f" {'PASS' if lg['ok'] else 'FAIL'} ({lg['rows']} rows, {lg['prefix_rows']} on their first {lg['window']} tokens)"
        f" | {len(planted) - len(missed)}/{len(planted)}{' missed: ' + ', '.join(missed) if missed else ''};"
        f" logits check failed {len(by_logits)}: {', '.join(by_logits)}"
        f"{'; NOT ' + ', '.join(unseen) if unseen else ''} |"
    )


def broken(cells: list[dict]) -> list[dict]:
    """The cells that raised, failed on the right capture, or let a planted mistake pass (with a logprob window
    also: the scalable validation failed the right shards, let a planted one pass, or its logits check let one of
    LOGITS_VISIBLE pass)."""

    def window_broken(c: dict) -> bool:
        planted = c["planted"]
        return "logits" in c and (
            not c["logits"]["ok"]
            or not all(p["scalable_caught"] for p in planted.values())
            or not all(planted[m]["logits_failed"] for m in LOGITS_VISIBLE if m in planted)
        )

    return [
        c
        for c in cells
        if "error" in c
        or not c["correct_ok"]
        or not all(p["caught"] for p in c["planted"].values())
        or window_broken(c)
    ]
