"""The logits check (validate.reference: scalable; DESIGN.md §6): the final norm and lm_head applied to the
captured id N (the pre-norm final state) must reproduce the engine's stored prompt logprobs
(logprobs.safetensors), within what bf16 does to them."""

from __future__ import annotations

from typing import Any

from ..check import Checks
from ..shard.layout import LOGPROBS
from ..shard.readers import read_logprobs
from .passrule import FLOOR_FACTOR, STORAGE_FACTOR
from .slices import as_checkpoint, torch_dtype
from .subject import ShardUnderTest

HEAD_CHUNK = 256  # tokens per lm_head matmul: Kimi's logits are 0.66 MB a token in fp32

# A right capture's logprobs differ from the fp32 recompute by lm_head rounding: per token up to ~1 nat
# in bf16 where the logits are large (a single token can reach |d| ~ 1), so no bound is put on the worst
# token. The row's mean and 90th percentile |d| are bounded by FLOOR_FACTOR x the bf16-vs-fp32 floor's
# (or LP_MIN), and its correlation with the recompute may fall short of 1 by FLOOR_FACTOR x the floor's.
LP_MIN = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}  # nats: fp32 summation order, half rounding
CORR_MIN = 1e-3  # 1 - correlation always allowed


def logprobs_from_state(model, state_n, token_ids: list[int], dtype="float32", head=None):
    """[T-1] float32: log p(token i | tokens < i) for i >= 1, from the pre-norm final state [T, H] of one row.

    Only the final norm and lm_head are loaded (by name; `head` reuses a loaded pair). log_softmax runs
    in fp32 whatever `dtype` the norm and lm_head run in, as engines compute prompt logprobs.
    """
    import torch

    norm, lm_head = head or as_checkpoint(model).head(torch_dtype(dtype))
    ids = torch.as_tensor(token_ids[1:], dtype=torch.long)
    x = state_n[:-1].to(torch_dtype(dtype))
    out = []
    with torch.inference_mode():
        for s in range(0, x.shape[0], HEAD_CHUNK):
            logits = lm_head(norm(x[s : s + HEAD_CHUNK])).float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[s : s + HEAD_CHUNK, None])[:, 0])
    return torch.cat(out) if out else torch.zeros(0)


def _deviation(x, recomputed) -> tuple[float, float, float]:
    """Mean and 90th percentile |x - recomputed|, and 1 - their Pearson correlation."""
    import torch

    d = (x - recomputed).abs()
    c = torch.corrcoef(torch.stack([x, recomputed]))[0, 1] if x.numel() > 1 else torch.tensor(1.0)
    return float(d.mean()), float(d.quantile(0.9)), 1.0 - float(c.nan_to_num(1.0))


def judge_logprobs(stored, recomputed, floor=None, dtype: str = "bfloat16", drawn=None) -> dict[str, Any]:
    """Verdict for one row: stored (engine) vs recomputed (fp32 from the captured state) prompt logprobs.

    `floor`: the same recompute at the working precision (None = exact). The bound scales with what that
    precision does to the logprobs: mean and p90 of |stored - recomputed| within FLOOR_FACTOR x the
    floor's (at least LP_MIN), and 1 - Pearson correlation within FLOOR_FACTOR x the floor's (at least
    CORR_MIN). A wrong state (another layer, row or position) moves the mean by nats, not hundredths;
    a state that is only scaled is invisible here (the final RMSNorm removes the scale).
    `drawn`: for a shard stored scaled (FP8, MXFP4), the recompute from a state that storage could have rounded
    to the captured one (StorageFormat.draw): each bound grows by STORAGE_FACTOR x its deviation, the storage
    floor.
    """
    import torch

    stored, recomputed = torch.as_tensor(stored).float(), torch.as_tensor(recomputed).float()
    if stored.numel() == recomputed.numel() + 1:
        stored = stored[1:]  # the engine's position 0 (no logprob)
    floor = recomputed if floor is None else torch.as_tensor(floor).float()
    (mean, p90, decorr), (fmean, fp90, fdecorr) = _deviation(stored, recomputed), _deviation(floor, recomputed)
    qmean, qp90, qdecorr = (
        _deviation(torch.as_tensor(drawn).float(), recomputed) if drawn is not None else (0.0, 0.0, 0.0)
    )
    bounds = {
        "mean": max(FLOOR_FACTOR * fmean, LP_MIN[dtype]) + STORAGE_FACTOR * qmean,
        "p90": max(FLOOR_FACTOR * fp90, LP_MIN[dtype]) + STORAGE_FACTOR * qp90,
        "decorr": max(FLOOR_FACTOR * fdecorr, CORR_MIN) + STORAGE_FACTOR * qdecorr,
    }
    values = {"mean": mean, "p90": p90, "decorr": decorr}
    failed = [k for k in values if values[k] > bounds[k]]
    return {
        "tokens": int(stored.numel()),
        **values,
        "floor": {"mean": fmean, "p90": fp90, "decorr": fdecorr},
        **({"storage_floor": {"mean": qmean, "p90": qp90, "decorr": qdecorr}} if drawn is not None else {}),
        "bounds": bounds,
        "max_abs": float((stored - recomputed).abs().max()) if stored.numel() else 0.0,
        "ok": not failed,
        "criterion": failed[0] if failed else "",
    }


def check_logprobs(model, states_n: list[Any], token_ids: list[list[int]], stored: list[Any], dtype: str, scaled=None):
    """Per-row verdicts (judge_logprobs) of stored engine logprobs against the captured id N states
    (`scaled`: the scaled StorageFormat they were stored in, None for the model dtype; its floor comes from a
    fixed-seed rounding draw of each state)."""
    import torch

    ckpt = as_checkpoint(model)
    heads = {d: ckpt.head(torch_dtype(d)) for d in {"float32", dtype}}
    draws = torch.Generator().manual_seed(0)
    out = []
    for s, ids, st in zip(states_n, token_ids, stored, strict=True):
        # A row longer than the engine's logprob window stores the logprobs of its first tokens only
        # (vllm/memory.py): the state at a position depends on the tokens before it alone.
        covered = min(len(ids), int(torch.as_tensor(st).numel()) + 1)
        s, part = s[:covered], list(ids[:covered])
        ref = logprobs_from_state(ckpt, s, part, head=heads["float32"])
        floor = logprobs_from_state(ckpt, s, part, dtype, head=heads[dtype]) if dtype != "float32" else None
        q = logprobs_from_state(ckpt, scaled.draw(s, draws), part, head=heads["float32"]) if scaled else None
        out.append({**judge_logprobs(st, ref, floor, dtype, q), "covered_tokens": covered, "row_tokens": len(ids)})
    return out


def check_logits(subject: ShardUnderTest, model_path: str, checks: Checks) -> list[dict[str, Any]]:
    """The logits check on the rows whose prompt logprobs the engine stored: the report's per-row verdicts and
    one `logits` check (passed as skipped when the shard stores none or has no id N)."""
    import torch

    m, scaled = subject.manifest, subject.scaled
    if LOGPROBS not in m.files or m.num_hidden_layers not in m.layer_ids:
        checks.add("logits", True, "skipped: the shard stores no prompt logprobs or has no id N")
        return []
    lp_rows, stored = read_logprobs(subject.dir)
    states = subject.states(m.num_hidden_layers, lp_rows, torch.float32 if scaled else None)
    tokens = [subject.rows[i]["input_ids"] for i in lp_rows]
    verdicts = check_logprobs(model_path, states, tokens, stored, m.dtype, scaled)
    out = [{"row": subject.shard.index[i].row, **v} for i, v in zip(lp_rows, verdicts, strict=True)]
    failed = [v for v in out if not v["ok"]]
    detail = f"{len(verdicts)} rows: final norm + lm_head on id {m.num_hidden_layers} reproduce the engine's logprobs"
    if failed:
        v = failed[0]
        detail = (
            f"{len(failed)} of {len(verdicts)} rows fail; first: row {v['row']}: {v['criterion']} "
            f"{v[v['criterion']]:.3g} > bound {v['bounds'][v['criterion']]:.3g} (floor run: {m.dtype} lm_head"
            + (
                f" + {STORAGE_FACTOR:g} x {scaled.label} floor {v['storage_floor'][v['criterion']]:.3g})"
                if scaled
                else ")"
            )
        )
    part = [f"row {v['row']} on its first {v['covered_tokens']} of {v['row_tokens']} tokens" for v in out
            if v["covered_tokens"] < v["row_tokens"]]  # fmt: skip
    checks.add("logits", not failed, detail + ("; checked " + ", ".join(part) if part else ""))
    return out
