"""Checks that need only a slice of the model, for targets too large for a full reference forward.

- Window check: from the captured state at id a, decoder layers a..b-1 alone (one layer's weights in
  memory at a time) must reproduce the captured id b, judged like the full reference (passrule.py):
  per-token error against the fp32 run, relative to the working-precision run from the same input.
- Logits check: the final norm and lm_head applied to the captured id N must reproduce the engine's
  stored prompt logprobs, within what bf16 does to them.
Layer ids follow layers.py: id k is the input of decoder layer k, id N the pre-norm final state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .passrule import FLOOR_FACTOR, FP8_FACTOR, describe_failure, fp8_floor, judge_layer, judge_tokens, token_errors
from .slices import Checkpoint, raw_config

HEAD_CHUNK = 256  # tokens per lm_head matmul: Kimi's logits are 0.66 MB a token in fp32


def _ckpt(model) -> Checkpoint:
    return model if isinstance(model, Checkpoint) else Checkpoint(model)


def _dtype(name):
    import torch

    return getattr(torch, name) if isinstance(name, str) else name


def _layer_forward(layer, rotary, x, pos=None):
    """One decoder layer on one row [T, H], causal (sdpa with no mask): positions 0..T-1, or `pos` [3, 1, T]
    (a row with images: Qwen2.5-VL's 3-D rope positions, tokenization.row_inputs.RowImages.positions)."""
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

    ckpt = _ckpt(model)
    if not 0 <= a < b <= ckpt.config.num_hidden_layers:
        raise ValueError(f"window {a}->{b} is not within 0..{ckpt.config.num_hidden_layers}")
    order = sorted(dtypes, key=lambda d: _dtype(d).itemsize)
    rotary = ckpt.rotary()
    cur = {d: [s.to(_dtype(d)) for s in states] for d in order}
    positions = positions or [None] * len(states)
    with torch.inference_mode():
        for k in range(a, b):
            layer = ckpt.layer(k, _dtype(order[0])).eval()
            for i, d in enumerate(order):
                if i:
                    _recast(ckpt, layer, d)
                cur[d] = [_layer_forward(layer, rotary, x, p) for x, p in zip(cur[d], positions, strict=True)]
            del layer
            ckpt.close()
    return cur


def _recast(ckpt: Checkpoint, layer, dtype) -> None:
    from .slices import cast

    cast(layer, _dtype(dtype), ckpt._keep_fp32())


def check_window(
    model,
    captured_a: list[Any],
    captured_b: list[Any],
    a: int,
    b: int,
    dtype: str,
    rows: list[int] | None = None,
    fp8: bool = False,
    positions: list[Any] | None = None,
) -> list[dict[str, Any]]:
    """Verdicts (passrule.judge_tokens, then judge_layer over the rows) of captured id b against layers a..b-1.

    Reference: the window in fp32 from the captured id a; floor: the window at `dtype` from the same
    input (none for fp32 captures); `fp8`: the shard is stored as FP8, so the reference's FP8 floor is
    added. A capture whose ids a and b disagree with the layers between fails.
    """
    runs = run_window(model, captured_a, a, b, ("float32",) if dtype == "float32" else (dtype, "float32"), positions)
    rows = list(range(len(captured_a))) if rows is None else rows
    verdicts = []
    for i, got in enumerate(captured_b):
        ref = runs["float32"][i]
        floor = token_errors(runs[dtype][i], ref) if dtype != "float32" else None
        qtok = fp8_floor(ref) if fp8 else None
        verdicts.append({"row": rows[i], "window": [a, b], **judge_tokens(token_errors(got, ref), floor, dtype, qtok)})
    judge_layer(verdicts)
    return verdicts


# ---------------------------------------------------------------------------------------------- logits


def logprobs_from_state(model, state_n, token_ids: list[int], dtype="float32", head=None):
    """[T-1] float32: log p(token i | tokens < i) for i >= 1, from the pre-norm final state [T, H] of one row.

    Only the final norm and lm_head are loaded (by name; `head` reuses a loaded pair). log_softmax runs
    in fp32 whatever `dtype` the norm and lm_head run in, as engines compute prompt logprobs.
    """
    import torch

    norm, lm_head = head or _ckpt(model).head(_dtype(dtype))
    ids = torch.as_tensor(token_ids[1:], dtype=torch.long)
    x = state_n[:-1].to(_dtype(dtype))
    out = []
    with torch.inference_mode():
        for s in range(0, x.shape[0], HEAD_CHUNK):
            logits = lm_head(norm(x[s : s + HEAD_CHUNK])).float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[s : s + HEAD_CHUNK, None])[:, 0])
    return torch.cat(out) if out else torch.zeros(0)


# A right capture's logprobs differ from the fp32 recompute by lm_head rounding: per token up to ~1 nat
# in bf16 where the logits are large (a single token can reach |d| ~ 1), so no bound is put on the worst
# token. The row's mean and 90th percentile |d| are bounded by FLOOR_FACTOR x the bf16-vs-fp32 floor's
# (or LP_MIN), and its correlation with the recompute may fall short of 1 by FLOOR_FACTOR x the floor's.
LP_MIN = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}  # nats: fp32 summation order, half rounding
CORR_MIN = 1e-3  # 1 - correlation always allowed


def judge_logprobs(stored, recomputed, floor=None, dtype: str = "bfloat16", fp8=None) -> dict[str, Any]:
    """Verdict for one row: stored (engine) vs recomputed (fp32 from the captured state) prompt logprobs.

    `floor`: the same recompute at the working precision (None = exact). The bound scales with what that
    precision does to the logprobs: mean and p90 of |stored - recomputed| within FLOOR_FACTOR x the
    floor's (at least LP_MIN), and 1 - Pearson correlation within FLOOR_FACTOR x the floor's (at least
    CORR_MIN). A wrong state (another layer, row or position) moves the mean by nats, not hundredths;
    a state that is only scaled is invisible here (the final RMSNorm removes the scale).
    `fp8`: for a shard stored as FP8, the recompute from a state FP8 could have rounded to the captured
    one (fp8.rounding_draw): each bound grows by FP8_FACTOR x its deviation, the FP8 floor.
    """
    import torch

    stored, recomputed = torch.as_tensor(stored).float(), torch.as_tensor(recomputed).float()
    if stored.numel() == recomputed.numel() + 1:
        stored = stored[1:]  # the engine's position 0 (no logprob)
    floor = recomputed if floor is None else torch.as_tensor(floor).float()

    def stats(x):
        d = (x - recomputed).abs()
        c = torch.corrcoef(torch.stack([x, recomputed]))[0, 1] if x.numel() > 1 else torch.tensor(1.0)
        return float(d.mean()), float(d.quantile(0.9)), 1.0 - float(c.nan_to_num(1.0))

    (mean, p90, decorr), (fmean, fp90, fdecorr) = stats(stored), stats(floor)
    qmean, qp90, qdecorr = stats(torch.as_tensor(fp8).float()) if fp8 is not None else (0.0, 0.0, 0.0)
    bounds = {
        "mean": max(FLOOR_FACTOR * fmean, LP_MIN[dtype]) + FP8_FACTOR * qmean,
        "p90": max(FLOOR_FACTOR * fp90, LP_MIN[dtype]) + FP8_FACTOR * qp90,
        "decorr": max(FLOOR_FACTOR * fdecorr, CORR_MIN) + FP8_FACTOR * qdecorr,
    }
    values = {"mean": mean, "p90": p90, "decorr": decorr}
    failed = [k for k in values if values[k] > bounds[k]]
    return {
        "tokens": int(stored.numel()),
        **values,
        "floor": {"mean": fmean, "p90": fp90, "decorr": fdecorr},
        **({"fp8_floor": {"mean": qmean, "p90": qp90, "decorr": qdecorr}} if fp8 is not None else {}),
        "bounds": bounds,
        "max_abs": float((stored - recomputed).abs().max()) if stored.numel() else 0.0,
        "ok": not failed,
        "criterion": failed[0] if failed else "",
    }


def check_logprobs(
    model, states_n: list[Any], token_ids: list[list[int]], stored: list[Any], dtype: str, fp8: bool = False
):
    """Per-row verdicts (judge_logprobs) of stored engine logprobs against the captured id N states
    (`fp8`: stored as FP8; the FP8 floor comes from a fixed-seed rounding draw of each state)."""
    import torch

    from .shard.fp8 import rounding_draw

    ckpt = _ckpt(model)
    heads = {d: ckpt.head(_dtype(d)) for d in {"float32", dtype}}
    draws = torch.Generator().manual_seed(0)
    out = []
    for s, ids, st in zip(states_n, token_ids, stored, strict=True):
        ref = logprobs_from_state(ckpt, s, ids, head=heads["float32"])
        floor = logprobs_from_state(ckpt, s, ids, dtype, head=heads[dtype]) if dtype != "float32" else None
        q = logprobs_from_state(ckpt, rounding_draw(s, draws), ids, head=heads["float32"]) if fp8 else None
        out.append(judge_logprobs(st, ref, floor, dtype, q))
    return out


# ---------------------------------------------------------------------------------------------- validate


def validate_scalable(shard, rows: list[dict[str, Any]], model_path: str, picks: list[int], windows, checks):
    """validate.reference: scalable on one shard (shardset.Shard): the window checks on the sampled rows
    and the logits check on the rows whose prompt logprobs the engine stored; results go to `checks`
    (validate.Checks). FP8 shards are read dequantized and judged with their FP8 floor."""
    import torch
    from safetensors import safe_open

    from .shard.layout import FP8_E4M3, LOGPROBS, layer_file
    from .shard.readers import LayerReader
    from .tokenization.row_inputs import RowImages

    m, ids = shard.manifest, shard.manifest.layer_ids
    fp8 = m.storage_name == FP8_E4M3
    windows = windows if windows is not None else ([ids[-2:]] if len(ids) >= 2 else [])
    images = RowImages(model_path, shard.tokenized)  # rows with images run at their 3-D rope positions
    positions = [images.positions(rows[i]) if rows[i].get("images") else None for i in picks]
    out: dict[str, Any] = {"windows": {}, "logits": []}

    def rows_of(lid: int, positions: list[int]) -> list[Any]:
        reader, index = LayerReader(shard.dir / layer_file(lid)), shard.index
        return [reader.rows(index[i].offset, index[i].offset + index[i].length, torch.float32 if fp8 else None)
                for i in positions]  # fmt: skip

    for a, b in windows:
        if a not in ids or b not in ids or a >= b:
            checks.add(f"window:{a}-{b}", False, f"validate.windows: [{a}, {b}] needs two captured ids a < b of {ids}")
            continue
        global_rows = [shard.index[i].row for i in picks]
        verdicts = check_window(
            model_path, rows_of(a, picks), rows_of(b, picks), a, b, m.dtype, global_rows, fp8, positions
        )
        out["windows"][f"{a}-{b}"] = verdicts
        failed = [v for v in verdicts if not v["ok"]]
        detail = f"{len(verdicts)} rows through layers {a}..{b - 1}"
        if failed:
            detail = f"{len(failed)} of {len(verdicts)} rows fail; first: " + describe_failure(
                failed[0], m.dtype, f"layers {a}..{b - 1} alone from the captured id {a}" + (", FP8" if fp8 else "")
            )
        checks.add(f"window:{a}-{b}", not failed, detail)
    if LOGPROBS not in m.files or m.num_hidden_layers not in ids:
        checks.add("logits", True, "skipped: the shard stores no prompt logprobs or has no id N")
        return out
    with safe_open(shard.dir / LOGPROBS, framework="pt") as f:
        lp_rows, offsets, stored = f.get_tensor("rows").tolist(), f.get_tensor("offsets"), f.get_tensor("logprobs")
    states = rows_of(m.num_hidden_layers, lp_rows)
    tokens = [rows[i]["input_ids"] for i in lp_rows]
    stored_rows = [stored[offsets[k] : offsets[k + 1]] for k in range(len(lp_rows))]
    verdicts = check_logprobs(model_path, states, tokens, stored_rows, m.dtype, fp8)
    out["logits"] = [{"row": shard.index[i].row, **v} for i, v in zip(lp_rows, verdicts, strict=True)]
    failed = [v for v in out["logits"] if not v["ok"]]
    detail = f"{len(verdicts)} rows: final norm + lm_head on id {m.num_hidden_layers} reproduce the engine's logprobs"
    if failed:
        v = failed[0]
        detail = (
            f"{len(failed)} of {len(verdicts)} rows fail; first: row {v['row']}: {v['criterion']} "
            f"{v[v['criterion']]:.3g} > bound {v['bounds'][v['criterion']]:.3g} (floor run: {m.dtype} lm_head"
            + (f" + {FP8_FACTOR:g} x FP8 floor {v['fp8_floor'][v['criterion']]:.3g})" if fp8 else ")")
        )
    checks.add("logits", not failed, detail)
    return out


# ---------------------------------------------------------------------------------------------- memory


def check_memory(model, layer_ids: list[int], windows: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """Bytes the two checks need, from config.json shapes alone (the module tree built on the meta device).

    logits: final norm + lm_head in fp32 plus their bf16 copy and one chunk of fp32 logits.
    window: the largest window's decoder-layer parameters at bf16 after dequantization (what it reads);
    layer_peak: the largest single layer held at bf16 and upcast to fp32 at once (run_window's peak).
    `windows` defaults to consecutive pairs of `layer_ids`.
    """
    from .slices import hf_config

    if isinstance(model, Checkpoint):
        config = model.config
    elif isinstance(model, dict):
        config = hf_config(model.get("text_config", model))
    else:
        config = hf_config(raw_config(Path(model)))
    skel = _skeleton_only(config)
    n = config.num_hidden_layers
    windows = windows or list(zip(layer_ids[:-1], layer_ids[1:], strict=False))
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in skel.model.layers]
    head = sum(p.numel() for p in skel.model.norm.parameters()) + skel.lm_head.weight.numel()
    sizes = {(a, b): 2 * sum(per_layer[a:b]) for a, b in windows}
    largest = max(sizes, key=sizes.get) if sizes else None
    return {
        "num_hidden_layers": n,
        "logits_bytes": 6 * head + 4 * HEAD_CHUNK * config.vocab_size,
        "window_bytes": sizes[largest] if largest else 0,
        "largest_window": list(largest) if largest else None,
        "layer_peak_bytes": max((6 * per_layer[k] for a, b in windows for k in range(a, b)), default=0),
        "windows": {f"{a}->{b}": v for (a, b), v in sizes.items()},
    }


def _skeleton_only(config):
    import torch
    from transformers import AutoModelForCausalLM

    from .slices import text_skeleton

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:  # a VLM's text config (slices.Checkpoint.skeleton)
            return text_skeleton(config)
