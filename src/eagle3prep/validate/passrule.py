"""The pass rule: is one captured row, at one layer, as close to fp32 as its precision allows? (DESIGN.md §6)

A capture is judged against the exact fp32 reference *relative to the floor run*: transformers at the
engine's working precision on the same row. Per token, the error is |x_t - r_t| / |r_t|. Per row:
- diverged tokens (error above TOKEN_FACTOR x the floor run's median token error, and above
  TOKEN_MIN): a MoE re-routes a few tokens at any precision below the reference's, so the capture may
  have as many as the floor run has, with Poisson-like slack;
- relative error (RMS of the other tokens' errors): at most FLOOR_FACTOR x the floor run's, or MIN_REL;
- a *routing cascade* (divergence that starts mid-row, no token moved by more than CASCADE_MAX: one
  re-routed token reaches every later token through causal attention) is judged on the tokens before
  it alone. Per shard and layer, cascade rows may be as many as the floor run's rows with divergence,
  with the same slack (`cascades_allowed`), and diverged tokens at most LAYER_DIVERGED_MAX of all;
- a *near-tie cascade* (fp32): divergence that starts at a token whose router margin (routing.py, from
  the exact reference) is within TIE_BAND of a tie is judged on the tokens before it, however far that
  token moved, and counts against neither allowance: the margin shows rounding alone could re-route it.
A scaled storage (FP8, MXFP4) adds its own rounding on top of the working precision's: the *storage floor* is
the error of the reference itself stored that way (the same encoding, shard/formats.py), per token, and both the
token bound and the relative-error bound grow by STORAGE_FACTOR times it: the bounds widen by the format's own
error and nothing else.
"""

from __future__ import annotations

import math
from typing import Any

# The constants' figures (what the validation matrix and the seed sweep measured) are in DESIGN.md §6.
TOKEN_FACTOR = 8.0  # a token this far above the row's typical rounding error took another path
TOKEN_MIN = 0.01  # ... and never below 1 %: no rounding moves a state that far (fp32 floors are ~0)
CASCADE_MAX = 0.5  # above every re-routed token of the matrix, below a wrong token (~1)
LAYER_DIVERGED_MAX = 0.1  # a layer's share of diverged tokens never needs to pass this
FLOOR_FACTOR = 4.0  # 3 left too little room for cascade rows judged on a short prefix
# The smallest relative-error bound per stored dtype: an exact floor (fp32 on a CPU) still leaves room
# for summation order, and a bf16 value stored as fp32 still fails.
MIN_REL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2}
# A scaled storage: the capture's rounding is another draw from the reference's (other values, other scales),
# so its error may exceed the reference's storage floor; an exact capture sits at 1 / STORAGE_FACTOR of the bound.
STORAGE_FACTOR = 1.5
# Near-ties: a relative router margin (routing.margins) under TIE_FACTOR fp32 epsilons is one rounding can
# flip; TIE_FACTOR is 4.3x the most a correct fp32 capture moved a margin (MARGIN_MOVED). fp32 only: bf16/fp16
# (and TF32) floor runs re-route at the engine's rate, and 2048 x 2^-8 > 1.
MARGIN_MOVED = 471.0
TIE_FACTOR = 2048.0
TIE_BAND = {"float32": TIE_FACTOR * 2.0**-23}


def allowed_diverged(floor_count: int) -> int:
    """How many events (diverged tokens, cascade rows) a capture may have when the floor run has `floor_count`.

    Both counts are draws of the same rate (which tokens flip differs between runs): 2x the floor's
    plus three Poisson standard deviations; 3 when the floor has none.
    """
    return int(2 * floor_count + 3 * math.sqrt(floor_count + 1))


def token_errors(x, ref):
    """Per token |x_t - r_t| / |r_t| ([T] float32 tensor) of [T, H] states."""
    x, ref = x.float(), ref.float()
    return (x - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)


def _rms(e, keep) -> float:
    if not bool(keep.any()):
        keep = keep | True  # every token diverged: the error over all of them
    return float(e[keep].pow(2).mean().sqrt())


def storage_floor(reference, storage):
    """Per-token error [T] of the reference stored in `storage` (a StorageFormat) and read back: what that
    storage alone costs."""
    return token_errors(storage.roundtrip(reference), reference)


def judge_row(captured, reference, floor, dtype: str, scaled=None, margins=None) -> dict[str, Any]:
    """The verdict for one row at one layer ([T, H] tensors; `floor` None when the reference is exact;
    `scaled`: the scaled StorageFormat the capture was stored in, judged with the reference's storage floor
    on top (None: the model dtype); `margins`: [T] router margins of the MoE layers before this one, None for a
    dense model)."""
    import torch

    cos = torch.nn.functional.cosine_similarity(captured.float(), reference.float(), dim=-1)
    ftok = token_errors(floor, reference) if floor is not None else None
    qtok = storage_floor(reference, scaled) if scaled is not None else None
    verdict = judge_tokens(token_errors(captured, reference), ftok, dtype, qtok, margins)
    if scaled is not None:
        verdict["stored_as"] = scaled.label
    return {**verdict, "min_cos": float(cos.min())}


def judge_tokens(tok, ftok, dtype: str, qtok=None, margins=None) -> dict[str, Any]:
    """The verdict from per-token errors of the capture (`tok`), the floor run (`ftok`, None = exact),
    for a scaled storage the reference's storage floor (`qtok`, None = the model dtype) and for a MoE the
    smallest router margin per token over the layers before this one (`margins`, None = dense).

    Returns the measured values, their bounds, `ok`, `cascade`, `tie` (a near-tie cascade), the failing
    `criterion` ('' when ok) and `worst_pos`, the token position a reader should look at first.
    """
    import torch

    tok = torch.as_tensor(tok, dtype=torch.float32)
    ftok_given = ftok is not None
    ftok = torch.zeros_like(tok) if ftok is None else torch.as_tensor(ftok, dtype=torch.float32)
    qtok = torch.zeros_like(tok) if qtok is None else torch.as_tensor(qtok, dtype=torch.float32)
    token_bound = max(TOKEN_FACTOR * float(ftok.median()), TOKEN_MIN)
    # The floor run is not stored scaled: its re-routed tokens are counted against the plain bound.
    diverged, fdiv = tok > token_bound + STORAGE_FACTOR * qtok, ftok > token_bound
    n_div, n_fdiv = int(diverged.sum()), int(fdiv.sum())
    allowed = allowed_diverged(n_fdiv)
    first = int(torch.nonzero(diverged)[0]) if n_div else len(tok)
    margin = float(margins[first]) if margins is not None and first < len(tok) else None
    mid = 0 < first < len(tok)
    # A re-route can move a token any distance: where the margin shows a near-tie, its size is no evidence.
    tie = mid and margin is not None and margin < TIE_BAND.get(dtype, 0.0)
    # Causal attention carries a re-routed token to every later token, so a cascade is judged on the
    # tokens before it; any other divergence on the tokens that did not diverge. Against an exact reference
    # with margins known, rounding re-routes only at a near-tie: there a small move is no excuse either.
    small = mid and (ftok_given or margins is None) and float(tok[first:].max()) <= CASCADE_MAX
    cascade = tie or small
    judged = torch.arange(len(tok)) < first if cascade else ~diverged
    rel, floor_rel, storage_rel = _rms(tok, judged), _rms(ftok, ~fdiv), _rms(qtok, judged)
    bound_rel = max(FLOOR_FACTOR * floor_rel, MIN_REL[dtype]) + STORAGE_FACTOR * storage_rel
    if n_div > allowed and not cascade:
        criterion, worst_pos = "diverged_tokens", first  # where it starts
    elif rel > bound_rel:
        criterion, worst_pos = "rel", int(torch.where(judged, tok, -1.0).argmax())
    else:
        criterion, worst_pos = "", first if cascade else int(tok.argmax())
    return {
        "tokens": int(tok.numel()),
        "rel": rel,
        "floor_rel": floor_rel,
        "storage_rel": storage_rel,  # 0 unless stored scaled
        "bound_rel": bound_rel,
        "token_bound": token_bound,
        "diverged": n_div,
        "floor_diverged": n_fdiv,
        "allowed_diverged": allowed,
        "cascade": cascade,
        "tie": tie,
        "margin_at_first": margin,  # the router margin where the divergence starts (None: dense or none)
        "tie_band": TIE_BAND.get(dtype, 0.0),
        "worst_pos": worst_pos,
        "worst_pos_rel": float(tok[worst_pos]) if tok.numel() else 0.0,
        "ok": not criterion,
        "criterion": criterion,
    }


def cascades_allowed(rows: list[dict[str, Any]]) -> int:
    """Cascade rows one layer of a shard may have: as many as the floor run's rows with divergence, with slack."""
    return allowed_diverged(sum(r["floor_diverged"] > 0 for r in rows))


def judge_layer(rows: list[dict[str, Any]]) -> None:
    """The verdicts of one layer's rows of a shard, taken together (in place).

    Cascade rows beyond `cascades_allowed` fail; so do all rows with diverged tokens when the layer's
    share of diverged tokens exceeds twice the floor run's (with slack) and LAYER_DIVERGED_MAX: a
    mistake that moves every token moderately (a post-norm state) must not pass as cascades.
    """
    # Near-tie cascades are explained by their margin, not by a rate: neither allowance counts them.
    cascades = [r for r in rows if r["cascade"] and r["ok"] and not r.get("tie")]
    limit = cascades_allowed(rows)
    if len(cascades) > limit:
        for r in cascades:
            r.update(ok=False, criterion="cascades", cascades=len(cascades), cascades_allowed=limit)
    tokens = sum(r["tokens"] for r in rows) or 1
    share = sum(r["diverged"] for r in rows if not r.get("tie")) / tokens
    allowed = max(allowed_diverged(sum(r["floor_diverged"] for r in rows)) / tokens, LAYER_DIVERGED_MAX)
    if share > allowed:
        for r in rows:
            if r["diverged"] and r["ok"] and not r.get("tie"):
                r.update(ok=False, criterion="layer_diverged", layer_share=share, layer_share_allowed=allowed)


def describe_failure(r: dict[str, Any], dtype: str, floor: str) -> str:
    """One clause naming the row, the position, the criterion, the value, the bound and its floor."""
    where = f"row {r['row']} token {r['worst_pos']}"
    label = r.get("stored_as")
    scaled = f" + {STORAGE_FACTOR:g} x {label} floor" if r.get("storage_rel") else ""
    if r["criterion"] == "diverged_tokens":
        margin = r.get("margin_at_first")
        tie = f"; router margin there {margin:.3g}, near-tie band {r['tie_band']:.3g}" if margin is not None else ""
        return (
            f"{where}: {r['diverged']} of {r['tokens']} tokens diverged (token error > {r['token_bound']:.3g}{scaled}; "
            f"first at token {r['worst_pos']}, error {r['worst_pos_rel']:.3g}{tie}) > {r['allowed_diverged']} allowed "
            f"(floor run: {r['floor_diverged']}, {floor})"
        )
    if r["criterion"] == "layer_diverged":
        return (
            f"{where}: {r['layer_share']:.1%} of this layer's tokens diverged over the sampled rows > "
            f"{r['layer_share_allowed']:.1%} allowed ({floor})"
        )
    if r["criterion"] == "cascades":
        return (
            f"{where}: {r['cascades']} rows diverge mid-row (routing cascades) > {r['cascades_allowed']} allowed "
            f"by the floor run's rows with diverged tokens ({floor})"
        )
    if scaled:
        scaled = f" + {STORAGE_FACTOR:g} x {label} floor {r['storage_rel']:.3g} (the reference stored as {label})"
    return (
        f"{where}: relative error {r['rel']:.3g} > bound {r['bound_rel']:.3g} "
        f"(= max({FLOOR_FACTOR:g} x floor {r['floor_rel']:.3g}, {MIN_REL[dtype]:g}){scaled}; "
        f"floor run: {floor}; worst token error {r['worst_pos_rel']:.3g})"
    )


# Sampling: rows recomputed per shard so that a mistake on AFFECTED_SHARE of a shard's rows is missed
# with probability < MISS_RATE (a hypergeometric draw without replacement; at most 90 rows, since
# 0.95**90 < 0.01 bounds any shard size).
MISS_RATE = 0.01
AFFECTED_SHARE = 0.05


def miss_probability(rows: int, sampled: int, affected_share: float = AFFECTED_SHARE) -> float:
    """P(no affected row among `sampled` rows drawn without replacement from `rows`)."""
    bad = max(1, math.ceil(affected_share * rows))
    p = 1.0
    for i in range(min(sampled, rows)):  # the i-th draw misses the `bad` rows
        p *= max(rows - bad - i, 0) / (rows - i)
    return p


def rows_to_sample(rows: int, miss_rate: float = MISS_RATE, affected_share: float = AFFECTED_SHARE) -> int:
    """The fewest rows whose miss probability is below `miss_rate` (all rows of a small shard)."""
    bad = max(1, math.ceil(affected_share * rows))
    p = 1.0
    for n in range(rows):
        if p < miss_rate:
            return n
        p *= max(rows - bad - n, 0) / (rows - n)
    return rows
