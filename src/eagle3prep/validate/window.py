"""The window check (validate.reference: scalable; DESIGN.md §6): from the captured state at id a, decoder
layers a..b-1 alone (one layer's weights in memory at a time) must reproduce the captured id b, judged like
the full reference (passrule.py): per-token error against the fp32 run, relative to the working-precision
run from the same input. Layer ids follow layers.py: id k is the input of decoder layer k.
"""

from __future__ import annotations

from typing import Any

from ..check import Checks
from .passrule import describe_failure, judge_layer, judge_tokens, storage_floor, token_errors
from .slices import Checkpoint, as_checkpoint, cast, torch_dtype
from .subject import ShardUnderTest


def _layer_forward(layer, rotary, x, pos=None):
    """One decoder layer on one row [T, H], causal (sdpa with no mask): positions 0..T-1, or `pos` [3, 1, T]
    (a row with images: Qwen2.5-VL's 3-D rope positions, tokenize.row_inputs.RowImages.positions)."""
    import torch

    pos = torch.arange(x.shape[0])[None] if pos is None else pos
    h = x[None]
    out = layer(
        h, attention_mask=None, position_ids=pos[0] if pos.ndim == 3 else pos, position_embeddings=rotary(h, pos)
    )
    return (out[0] if isinstance(out, tuple) else out)[0]


def run_window(model, states: list[Any], a: int, b: int, dtypes=("float32",), positions=None) -> dict[str, list[Any]]:
    """{dtype: [state at id b per row]} from `states` (rows at id a), through decoder layers a..b-1;
    `positions`: per row, None (0..T-1) or its rope positions (_layer_forward).

    Each layer is loaded once in the lowest precision asked, run on every row, then upcast in place
    for the next precision, so a layer is held once (plus its upcast copy) and the int4 experts never.
    """
    import torch

    ckpt = as_checkpoint(model)
    if not 0 <= a < b <= ckpt.config.num_hidden_layers:
        raise ValueError(f"window {a}->{b} is not within 0..{ckpt.config.num_hidden_layers}")
    order = sorted(dtypes, key=lambda d: torch_dtype(d).itemsize)
    rotary = ckpt.rotary()
    cur = {d: [s.to(torch_dtype(d)) for s in states] for d in order}
    positions = positions or [None] * len(states)
    with torch.inference_mode():
        for k in range(a, b):
            layer = ckpt.layer(k, torch_dtype(order[0])).eval()
            for i, d in enumerate(order):
                if i:
                    _recast(ckpt, layer, d)
                cur[d] = [_layer_forward(layer, rotary, x, p) for x, p in zip(cur[d], positions, strict=True)]
            del layer
            ckpt.close()
    return cur


def _recast(ckpt: Checkpoint, layer, dtype) -> None:
    cast(layer, torch_dtype(dtype), ckpt._keep_fp32())


def check_window(
    model,
    captured_a: list[Any],
    captured_b: list[Any],
    a: int,
    b: int,
    dtype: str,
    rows: list[int] | None = None,
    scaled=None,
    positions: list[Any] | None = None,
) -> list[dict[str, Any]]:
    """Verdicts (passrule.judge_tokens, then judge_layer over the rows) of captured id b against layers a..b-1.

    Reference: the window in fp32 from the captured id a; floor: the window at `dtype` from the same
    input (none for fp32 captures); `scaled`: the scaled StorageFormat of the shard (None: the model
    dtype), whose floor on the reference is added. A capture whose ids a and b disagree with the layers between fails.
    """
    runs = run_window(model, captured_a, a, b, ("float32",) if dtype == "float32" else (dtype, "float32"), positions)
    rows = list(range(len(captured_a))) if rows is None else rows
    verdicts = []
    for i, got in enumerate(captured_b):
        ref = runs["float32"][i]
        floor = token_errors(runs[dtype][i], ref) if dtype != "float32" else None
        qtok = storage_floor(ref, scaled) if scaled is not None else None
        verdict = judge_tokens(token_errors(got, ref), floor, dtype, qtok)
        verdicts.append(
            {"row": rows[i], "window": [a, b], **verdict, **({"stored_as": scaled.label} if scaled else {})}
        )
    judge_layer(verdicts)
    return verdicts


def check_windows(
    subject: ShardUnderTest,
    model_path: str,
    picks: list[int],
    windows: list[list[int]],
    positions: list[Any],
    checks: Checks,
) -> dict[str, list[dict[str, Any]]]:
    """Each window [a, b] on the sampled rows `picks` (at their rope `positions`): the report's verdicts per
    window, one `window:a-b` check each. Scaled shards are read decoded and judged with their storage floor."""
    import torch

    m, ids, scaled = subject.manifest, subject.manifest.layer_ids, subject.scaled
    dtype = torch.float32 if scaled else None
    out = {}
    for a, b in windows:
        if a not in ids or b not in ids or a >= b:
            checks.add(f"window:{a}-{b}", False, f"validate.windows: [{a}, {b}] needs two captured ids a < b of {ids}")
            continue
        global_rows = [subject.shard.index[i].row for i in picks]
        captured_a, captured_b = subject.states(a, picks, dtype), subject.states(b, picks, dtype)
        verdicts = check_window(model_path, captured_a, captured_b, a, b, m.dtype, global_rows, scaled, positions)
        out[f"{a}-{b}"] = verdicts
        failed = [v for v in verdicts if not v["ok"]]
        detail = f"{len(verdicts)} rows through layers {a}..{b - 1}"
        if failed:
            detail = f"{len(failed)} of {len(verdicts)} rows fail; first: " + describe_failure(
                failed[0],
                m.dtype,
                f"layers {a}..{b - 1} alone from the captured id {a}" + (f", {scaled.label}" if scaled else ""),
            )
        checks.add(f"window:{a}-{b}", not failed, detail)
    return out
