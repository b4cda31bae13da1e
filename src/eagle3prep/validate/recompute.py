"""The reference check: sampled rows recomputed by an independent transformers forward (reference.py) and
every captured layer judged against it by the pass rule (passrule.py; DESIGN.md §6)."""

from __future__ import annotations

from typing import Any

from ..check import Checks
from ..shard.manifest import ShardManifest
from ..tokenize.row_inputs import RowImages
from ..vllm.engine.workarounds import KNOWN_BUGS, NO_WORKAROUNDS_ENV
from ..vllm.names import parse_version
from .passrule import STORAGE_FACTOR, describe_failure, judge_layer, judge_row
from .reference import ReferencePair
from .subject import ShardUnderTest


def check_reference(
    subject: ShardUnderTest, refs: ReferencePair, picks: list[int], checks: Checks, images: RowImages
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Recompute the `picks` rows (a row with images with its processor's pixels), judge every layer of each
    (passrule.judge_row), then each layer over the rows: (per-row verdicts, per-layer summaries)."""
    results = [v for i in picks for v in _judge_row(subject, refs, i, images)]
    summary = {}
    hint = known_engine_bug(subject.manifest)
    for lid in subject.manifest.layer_ids:
        mine = [r for r in results if r["layer_id"] == lid]
        if not mine:
            continue
        judge_layer(mine)
        summary[str(lid)] = s = _layer_summary(mine)
        failed = [r for r in mine if not r["ok"]]
        if failed:
            floor = refs.describe() + (f", shard stored as {subject.scaled.label}" if subject.scaled else "")
            detail = f"{len(failed)} of {len(mine)} rows fail; first: {describe_failure(failed[0], subject.manifest.dtype, floor)}"
            detail += f"; {hint}" if hint else ""
        else:
            detail = reference_ok_detail(s)
        checks.add(f"reference:layer_{lid}", not failed, detail)
    return results, summary


def _judge_row(subject: ShardUnderTest, refs: ReferencePair, i: int, images: RowImages) -> list[dict[str, Any]]:
    """One sampled row (position `i` of the shard), recomputed once and judged at every layer id."""
    import torch

    row, e, lids = subject.rows[i], subject.shard.index[i], subject.manifest.layer_ids
    pixels = images.image_inputs(row) if row.get("images") else None
    want, floor = refs.rows(row["input_ids"], lids, pixels)
    out = []
    for lid in lids:
        got = subject.layer(lid).rows(e.offset, e.offset + e.length, torch.float32)  # [T, H], decoded
        margins = refs.margins(row["input_ids"], lid, pixels)  # near-ties of the MoE layers before lid
        verdict = judge_row(
            got, want[lid], floor[lid] if floor else None, subject.manifest.dtype, subject.scaled, margins
        )
        out.append({"row": e.row, "layer_id": lid, **verdict})
    return out


def _layer_summary(mine: list[dict[str, Any]]) -> dict[str, Any]:
    """Per layer over the sampled rows: failures, the worst error against its bound, diverged shares."""
    # Each row has its own bound (its floor run's error): the worst row is the one nearest its bound,
    # and the largest error may sit on another row with a wider bound.
    worst = max(mine, key=lambda r: r["rel"] / r["bound_rel"])
    largest = max(mine, key=lambda r: r["rel"])
    tokens = sum(r["tokens"] for r in mine) or 1
    return {
        "rows": len(mine),
        "failed_rows": sum(not r["ok"] for r in mine),
        "max_rel": largest["rel"],
        "max_rel_row": largest["row"],
        "worst_rel": worst["rel"],
        "bound_rel": worst["bound_rel"],
        "worst_margin": worst["rel"] / worst["bound_rel"],
        "worst_row": worst["row"],
        # the part of the worst row's bound that is the storage format's own floor (0: the model dtype)
        "storage_share": STORAGE_FACTOR * worst.get("storage_rel", 0.0) / worst["bound_rel"],
        "storage_rel": worst.get("storage_rel", 0.0),
        "stored_as": worst.get("stored_as"),
        "cascade_rows": sum(r["cascade"] for r in mine),
        "tie_rows": sum(r["tie"] for r in mine),
        "diverged_share": sum(r["diverged"] for r in mine) / tokens,
        "floor_diverged_share": sum(r["floor_diverged"] for r in mine) / tokens,
    }


def reference_ok_detail(s: dict[str, Any]) -> str:
    """A passed layer's line. Every figure says what it is measured on: a row's error is the RMS over its
    tokens of |captured - reference| / |reference|; the worst row is the one nearest its own bound."""
    largest = (
        f"; largest error of any row {s['max_rel']:.3g} (row {s['max_rel_row']}, a wider bound)"
        if s.get("max_rel_row") is not None and s["max_rel_row"] != s["worst_row"]
        else ""
    )
    own = (
        f"; {s['storage_share']:.0%} of that bound is the {s['stored_as']} format's own floor ({STORAGE_FACTOR:g} x "
        f"{s['storage_rel']:.3g}: the reference stored as {s['stored_as']} and read back)"
        if s.get("storage_share")
        else ""
    )
    return (
        f"{s['rows']} rows ok; nearest its bound: row {s['worst_row']}, error {s['worst_rel']:.3g} = "
        f"{s['worst_margin']:.2f} x its bound {s['bound_rel']:.3g} (passes below 1; error = RMS over the row's "
        f"tokens of |captured - reference| / |reference|){own}{largest}; "
        f"diverged tokens {s['diverged_share']:.2%} of all sampled (floor run {s['floor_diverged_share']:.2%}); "
        f"routing cascades in {s['cascade_rows']} rows ({s['tie_rows']} at a router near-tie)"
    )


def known_engine_bug(manifest: ShardManifest) -> str:
    """The known engine bug (workarounds.KNOWN_BUGS) that fits this shard's engine and was not worked around."""
    engine = manifest.engine
    if engine.get("engine") != "vllm":
        return ""
    archs = engine.get("architectures") or manifest.model.get("architectures") or []
    version = parse_version(engine.get("engine_version", "0"))
    for bug in KNOWN_BUGS:
        if bug.applies(version, engine.get("platform") == "cpu", archs) and bug.name not in engine.get(
            "workarounds", []
        ):
            return (
                f"known engine bug {bug.name} was not worked around when this shard was captured: {bug.why}; "
                f"recapture with the workaround on (unset {NO_WORKAROUNDS_ENV})"
            )
    return ""
