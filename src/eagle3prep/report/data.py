"""What the report shows, as plain data: the row funnel, validation verdicts, reference margins,
hidden-state statistics and vocabulary coverage. No HTML or plotting here, so each piece is unit-tested
on small dicts, and old validation files (fewer keys) still load."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ..shard.layout import layer_file
from ..shard.readers import LayerReader, read_index

# The draft vocabulary sizes a user picks from (speculators' --draft-vocab-size).
DRAFT_VOCAB_SIZES = (8192, 16384, 32768, 65536)
# A token is an outlier when its L2 norm is this many times the layer's mean token norm in the shard.
OUTLIER_NORM_RATIO = 4.0
# Tokens read per layer per shard for the outlier share: bounds the report's reads and memory
# (the validate job already read every byte once; the report must not do it again).
OUTLIER_SAMPLE_TOKENS = 16384
OUTLIER_BLOCKS = 16  # the sample is this many evenly spaced runs of rows, not one run at the start

# Validation checks grouped into the columns of the per-shard verdict grid (name prefix -> column).
CHECK_GROUPS = (
    ("manifest", "manifest"),
    ("file:", "sha256"),
    ("no_stray_files", "stray files"),
    ("layer_files", "layer files"),
    ("row_count", "rows"),
    ("index_", "index"),
    ("tokenized_source", "source"),
    ("token_ids", "token ids"),
    ("shape:", "shape/dtype"),
    ("finite:", "finite"),
    ("reference", "reference"),
)


def load_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def funnel(counts: dict[str, Any], stats: dict[str, Any]) -> list[tuple[str, int | None, str]]:
    """Rows from the raw sources to the tokenized shards: (step, rows, note), each step's loss named.

    Truncated rows stay in the data (cut to max_seq_len); their lost tokens are shown when
    stats.json records them (`truncated_tokens`), else the note says they were not counted.
    """
    t = prepared_counts(counts)["totals"]
    out: list[tuple[str, int | None, str]] = [("rows in the sources", t["rows_in"], f"{t.get('files', '?')} files")]
    out.append(("duplicates dropped", -t["duplicates"], "same content as an earlier row"))
    out.append(_quarantine_step("prepare", t.get("quarantined", {})))
    out.append(("conversations kept by prepare", t["kept"], ""))
    if counts.get("stage") == "regenerate":
        r = counts["totals"]
        out.append(_quarantine_step("regenerate", r["quarantined"]))
        replies = r["replies"]
        note = f"{replies['requests']:,} replies by the target, {replies['length']:,} cut by max_tokens"
        out.append(("conversations regenerated", r["kept"], note))
    out.append(_quarantine_step("tokenize", stats.get("quarantined", {})))
    rows, trunc = stats["rows"], stats.get("truncated_rows", 0)
    lost = stats.get("truncated_tokens")
    if lost is not None:
        kept_tokens = stats["tokens"]
        note = f"{lost:,} tokens cut ({lost / max(kept_tokens + lost, 1):.2%} of all)"
    else:
        note = "tokens cut: not in stats.json"
    out.append(
        (f"truncated to {stats.get('max_seq_len', '?')} tokens (kept)", trunc, f"{share(trunc, rows)} of rows; {note}")
    )
    if trailing := stats.get("trailing_user_rows"):  # kept: their replies are trained on; the last turn is not
        note = "the last user message has no reply after it: its tokens are context, never trained on"
        out.append(("ending in a user turn (kept)", trailing, f"{share(trailing, rows)} of rows; {note}"))
    out.append(("rows out (tokenized, captured)", rows, f"{stats['tokens']:,} tokens"))
    return out


def image_facts(counts: dict[str, Any], stats: dict[str, Any], images_per_row: list[int]) -> dict[str, Any] | None:
    """What the report says about images, or None for a run that met none (its page is unchanged):
    rows with images, images per row, vision tokens and their share, and each stage's image quarantine reasons.

    A run met images when prepare counted them (counts.json lists `images` then, kept or quarantined) or
    tokenize kept image rows. Both stages name every image reason image_* / images_* (prepare.errors,
    tokenize.vision), so a reason added later is shown without a list to update here."""
    prepared = prepared_counts(counts)["totals"]
    if "images" not in prepared and not stats.get("image_rows"):
        return None

    def image_reasons(reasons: dict[str, int]) -> dict[str, int]:
        return {r: n for r, n in sorted(reasons.items()) if n and r.startswith("image")}

    per_row: dict[int, int] = {}
    for n in images_per_row:
        per_row[n] = per_row.get(n, 0) + 1
    return {
        "rows": stats["rows"],
        "image_rows": stats.get("image_rows", 0),
        "images": stats.get("images", 0),
        "rows_by_images": dict(sorted(per_row.items())),  # images in a row -> rows
        "image_tokens": stats.get("image_tokens", 0),
        "image_token_share": stats.get("image_token_share", 0.0),
        "prepare_images": prepared.get("images", 0),  # in the conversations prepare kept
        "quarantined": {
            "prepare": image_reasons(prepared.get("quarantined", {})),
            "tokenize": image_reasons(stats.get("quarantined", {})),
        },
    }


def prepared_counts(counts: dict[str, Any]) -> dict[str, Any]:
    """prepare's counts.json, also when `counts` is the regenerate stage's (which holds prepare's sources and totals)."""
    return counts["prepared"] if counts.get("stage") == "regenerate" else counts


def _quarantine_step(stage: str, reasons: dict[str, int]) -> tuple[str, int, str]:
    """One funnel line per stage; the note names every reason with its count."""
    named = {r: n for r, n in sorted(reasons.items()) if n}
    return (f"quarantined by {stage}", -sum(named.values()), ", ".join(f"{r} {n}" for r, n in named.items()))


def share(n: float, total: float) -> str:
    return f"{n / total:.1%}" if total else "n/a"


def check_grid(reports: list[dict[str, Any]]) -> tuple[list[str], list[list[tuple[str, str]]]]:
    """Per shard, one verdict per check group: ("ok"|"FAIL"|"skipped"|"-", tooltip with every detail)."""
    columns = [name for _, name in CHECK_GROUPS]
    grid = []
    for v in reports:
        row = []
        for prefix, name in CHECK_GROUPS:
            mine = [c for c in v.get("checks", []) if c["check"].startswith(prefix)]
            if name == "reference" and reference_skipped(v):
                row.append(("skipped", "no row was recomputed"))
                continue
            if not mine:
                row.append(("-", "no such check in this file"))
                continue
            bad = [c for c in mine if not c["ok"]]
            tip = "; ".join(f"{c['check']}: {c.get('detail') or 'ok'}" for c in (bad or mine))
            row.append(("FAIL" if bad else "ok", tip))
        grid.append(row)
    return columns, grid


def reference_skipped(v: dict[str, Any]) -> bool:
    """True when the shard's hidden states were not compared with a recomputation.

    New files say so in `reference_mode` ("off"), older ones and `sample_rows: 0` by an absent or
    empty `reference`. A shard without rows has nothing to compare and does not count as skipped.
    """
    if v.get("rows") == 0 or v.get("reference_mode") == "scalable":  # slice checks ran (window, logits)
        return False
    return v.get("reference_mode") == "off" or not v.get("reference")


def reference_margins(reports: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    """{layer id: [worst error / bound per shard]}; < 1 passes. None where a shard has no reference."""
    layers: dict[str, list[float | None]] = {}
    for k, v in enumerate(reports):
        per_layer = v.get("reference_layers")
        if per_layer:
            worst = {str(lid): s.get("worst_margin") for lid, s in per_layer.items()}
        else:  # older files: derive the margin from the per-row results
            worst = {}
            for r in v.get("reference") or []:
                m = r["rel"] / r["bound_rel"] if r.get("bound_rel") else math.inf
                worst[str(r["layer_id"])] = max(worst.get(str(r["layer_id"]), 0.0), m)
        for lid, m in worst.items():
            layers.setdefault(lid, [None] * len(reports))[k] = m
    return dict(sorted(layers.items(), key=lambda kv: int(kv[0])))


def layer_stat_series(reports: list[dict[str, Any]], outliers: list[dict[str, float]] | None = None) -> dict:
    """{stat: {layer id: [value per shard]}} for mean, std, max_abs and the outlier share."""
    out: dict[str, dict[str, list[float | None]]] = {s: {} for s in ("mean", "std", "max_abs", "outlier_share")}
    for k, v in enumerate(reports):
        for lid, s in v.get("layer_stats", {}).items():
            for stat in ("mean", "std", "max_abs"):
                out[stat].setdefault(lid, [None] * len(reports))[k] = s.get(stat)
            got = s.get("outlier_share", (outliers[k] if outliers else {}).get(lid))
            out["outlier_share"].setdefault(lid, [None] * len(reports))[k] = got
    return {stat: dict(sorted(series.items(), key=lambda kv: int(kv[0]))) for stat, series in out.items()}


def sampled_outlier_shares(shard_dir: str | Path, validation: dict[str, Any]) -> dict[str, float]:
    """{layer id: share of sampled tokens with norm > OUTLIER_NORM_RATIO x the layer's mean token norm}.

    Reads at most OUTLIER_SAMPLE_TOKENS rows per layer file, in OUTLIER_BLOCKS evenly spaced runs,
    so the report's cost does not grow with the shard. The mean norm comes from validation.
    """
    import torch

    shard = Path(shard_dir)
    tokens = sum(e.length for e in read_index(shard))
    if tokens == 0:
        return {}
    block = max(OUTLIER_SAMPLE_TOKENS // OUTLIER_BLOCKS, 1)
    starts = sorted({int(i * tokens / OUTLIER_BLOCKS) for i in range(OUTLIER_BLOCKS)})
    out = {}
    for lid, s in validation.get("layer_stats", {}).items():
        mean_norm = s.get("mean_token_norm")
        if not mean_norm or not (shard / layer_file(int(lid))).is_file():
            continue
        hit = seen = 0
        reader = LayerReader(shard / layer_file(int(lid)))  # FP8 dequantized
        end_prev = 0
        for a in starts:
            a = max(a, end_prev)  # blocks of a small shard overlap: read each row once
            b = min(a + block, tokens)
            if a >= b:
                continue
            norms = torch.linalg.vector_norm(reader.rows(a, b, torch.float32), dim=-1)  # [b - a]
            hit += int((norms > OUTLIER_NORM_RATIO * mean_norm).sum())
            seen += b - a
            end_prev = b
        out[lid] = hit / seen if seen else 0.0
    return out


def reference_summary(reports: list[dict[str, Any]]) -> str:
    """One line: how many rows were recomputed, against what, and the chance a bad 5 % of rows slipped by."""
    sampled = [v["reference_sample"] for v in reports if v.get("reference_sample")]
    floors = sorted({str(v["reference_floor"]) for v in reports if v.get("reference_floor")})
    if any(v.get("reference_mode") == "scalable" for v in reports):
        floors.append("the window and logits checks (validate.reference: scalable)")
    if not sampled:
        n = sum(len({r["row"] for r in v.get("reference") or []}) for v in reports)
        return f"{n} rows recomputed in all (an older validation file: no sample summary)"
    rows, of = sum(s["rows"] for s in sampled), sum(s["of"] for s in sampled)
    miss = max(s.get("miss_probability", 0.0) for s in sampled)
    return (
        f"{rows:,} of {of:,} rows recomputed with {', '.join(floors) or 'no reference'}; "
        f"worst shard's chance of missing a mistake on 5 % of its rows: {miss:.1%}"
    )


def reference_runs(reports: list[dict[str, Any]]) -> tuple[str, str] | None:
    """The two recomputations validation compares a capture with, each in words: the reference (transformers in
    float32, exact) with how many rows were recomputed, and the floor run (the same forward at the capture's
    precision, whose error sets each row's bound). None when no row was recomputed against them."""
    from ..validate.passrule import FLOOR_FACTOR

    sampled = [v["reference_sample"] for v in reports if v.get("reference_sample")]
    floors = sorted({str(v["reference_floor"]) for v in reports if v.get("reference_floor")})
    scalable = any(v.get("reference_mode") == "scalable" for v in reports)
    if not sampled or not (floors or scalable):
        return None
    rows, of = sum(s["rows"] for s in sampled), sum(s["of"] for s in sampled)
    miss = max(s.get("miss_probability", 0.0) for s in sampled)
    counted = (
        f"{rows:,} of {of:,} rows recomputed; worst shard's chance of missing a mistake on 5 % of its rows: {miss:.1%}"
    )
    if scalable:
        return f"the window and logits checks (validate.reference: scalable): {counted}", ", ".join(floors) or "none"
    # ReferencePair.describe: "transformers <dtype> on <device>", or "none (fp32 on a CPU: ...)"; the exact
    # reference runs on the same device.
    devices = {m.group(1) for f in floors if (m := re.search(r" on (\w+)$", f))}
    devices |= {"cpu"} if any(f.startswith("none") for f in floors) else set()
    floor = "; ".join(
        f if f.startswith("none") else f"{f}: the same forward at the capture's precision; each row's bound is at least "
        f"{FLOOR_FACTOR:g}x this run's error on it"
        for f in floors
    )  # fmt: skip
    return f"transformers float32 on {', '.join(sorted(devices))} (exact): {counted}", floor


# The quarantine reasons of conversations with tool calls or tool schemas, per stage (prepare.errors,
# regenerate.counts, tokenize.template.TOOL_REASON), and what each means when no record says more.
TOOL_REASONS = {
    ("prepare", "invalid_tool_call"): "a tool call without a function name, or tool calls or tools that are not JSON",
    ("regenerate", "tool_turns"): "regenerate.turns: all on a conversation with tool calls or results",
    ("tokenize", "tool_turns_unsupported_by_template"): "the chat template does not render tool turns",
}


def quarantine_facts(path: str | Path, reasons: tuple[str, ...] | None = None) -> dict[str, Any]:
    """One stage's quarantine.jsonl: {"by_source": {source file: {reason: n}}, "first": {reason: (where, detail)}},
    `where` the conversation's source ("file:line") when the record has one. `reasons`: only those are read (a
    line that does not name one is not parsed: prepare's file holds every bad raw record). A missing file: empty."""
    by_source: dict[str, dict[str, int]] = {}
    first: dict[str, tuple[str, str]] = {}
    if not Path(path).is_file():
        return {"by_source": by_source, "first": first}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if reasons is not None and not any(r in line for r in reasons):
                continue
            try:
                q = json.loads(line)
                reason, record = str(q["reason"]), q.get("record")
            except (ValueError, KeyError, TypeError):
                continue  # not a quarantine line: the stage's own check owns that file
            if reasons is not None and reason not in reasons:
                continue
            source = record.get("source") if isinstance(record, dict) else None
            file = str(source).rsplit(":", 1)[0] if source else "(no source recorded)"
            by_source.setdefault(file, {})
            by_source[file][reason] = by_source[file].get(reason, 0) + 1
            first.setdefault(reason, (str(source or f"{q.get('file')}:{q.get('line')}"), str(q.get("detail", ""))))
    return {"by_source": by_source, "first": first}


def source_losses(counts: dict[str, Any], later: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per source file: rows in, duplicates, what each stage quarantined ({stage: {reason: n}}; prepare's from
    counts.json, later stages' from `later`, {stage: quarantine_facts}) and the rows it still gives."""
    out = []
    files = prepared_counts(counts).get("files", [])
    for f in files:
        lost = {"prepare": {r: n for r, n in f["quarantined"].items() if n}}
        lost |= {stage: dict(sorted(facts["by_source"].get(f["file"], {}).items())) for stage, facts in later.items()}
        later_lost = sum(n for stage, reasons in lost.items() if stage != "prepare" for n in reasons.values())
        out.append({"file": f["file"], "rows_in": f["rows_in"], "duplicates": f["duplicates"], "lost": lost,
                    "rows_out": f["kept"] - later_lost})  # fmt: skip
    known = {f["file"] for f in files}
    for stage, facts in later.items():  # conversations whose source names no file of prepare's (none expected)
        for file, reasons in facts["by_source"].items():
            if file not in known:
                out.append({"file": file, "rows_in": None, "duplicates": None, "lost": {stage: reasons},
                            "rows_out": None})  # fmt: skip
    return out


def tool_quarantine(
    counts: dict[str, Any], stats: dict[str, Any], facts: dict[str, dict[str, Any]]
) -> dict[str, Any] | None:
    """How many conversations with tool calls each stage quarantined and why: {"total", "stages": [(stage, reason,
    n, (where, detail) of the first or None)]}; None when no stage quarantined one. `facts`: {stage:
    quarantine_facts} where read."""
    quarantined = {
        "prepare": prepared_counts(counts)["totals"].get("quarantined", {}),
        "regenerate": counts["totals"].get("quarantined", {}) if counts.get("stage") == "regenerate" else {},
        "tokenize": stats.get("quarantined", {}),
    }
    stages = [
        (stage, reason, n, facts.get(stage, {}).get("first", {}).get(reason))
        for stage, reason in TOOL_REASONS
        if (n := quarantined[stage].get(reason, 0))
    ]
    return {"total": sum(n for _, _, n, _ in stages), "stages": stages} if stages else None


def vocab_coverage(token_freq: dict[str, int], sizes: tuple[int, ...] = DRAFT_VOCAB_SIZES) -> dict[str, Any]:
    """Share of loss-masked tokens covered by the most frequent n ids, for a draft vocabulary of n.

    Returns the distinct ids seen, the share at each of `sizes`, and the whole curve (n, share)
    at about 200 log-spaced points, for the plot.
    """
    import numpy as np

    counts = np.sort(np.fromiter(token_freq.values(), dtype=np.int64))[::-1]
    total = int(counts.sum())
    cum = np.cumsum(counts) / total if total else np.zeros(0)

    def at(n: int) -> float:
        return float(cum[min(n, len(cum)) - 1]) if len(cum) else 0.0

    points = sorted({int(x) for x in np.geomspace(1, max(len(cum), 1), num=200)} | {len(cum)})
    return {
        "distinct_ids": len(cum),
        "masked_tokens": total,
        "at": {n: at(n) for n in sizes},
        "curve": [(n, at(n)) for n in points if n >= 1],
    }
