"""The report's HTML page: what a person needs before spending GPU-days on the data comes first (banners, the row
funnel, every check's verdict, the reference margins); details follow. One self-contained file (figures inlined),
laid out for a 1,000-pixel-wide window. What says "passed" is written through report.stale.while_current."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from ..infra.atomic import atomic_open
from ..shard.formats import storage_format
from . import data, drafts
from .stale import GREEN_BANNER, STALE_VERDICTS, while_current
from .tables import loss_banner, set_aside_banner, source_table, tool_banner
from .tables import table as _table

# A layer whose worst sampled row reaches this share of its bound is flagged before it fails.
NEAR_MISS = 0.8

esc = html.escape

STYLE = """
body{font-family:system-ui,sans-serif;font-size:14px;max-width:960px;margin:12px auto;padding:0 12px;color:#222}
h1{font-size:20px;margin:4px 0}h2{font-size:16px;margin:18px 0 6px;border-bottom:1px solid #ddd}
p{margin:4px 0}table{border-collapse:collapse;font-size:12.5px;margin:4px 0}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right;white-space:nowrap}table.w{width:100%}
th{background:#f3f3f3}td.l,th.l{text-align:left;white-space:normal}
.banner{padding:8px 12px;margin:8px 0;border-radius:4px;font-weight:600}
.bad{background:#fde2e1;border:1px solid #d33}.warn{background:#fff4d6;border:1px solid #d90}
.good{background:#e4f6e6;border:1px solid #3a3}
.ok{color:#176b2c}.FAIL{color:#fff;background:#c62828;font-weight:700}.skipped{background:#ffe9a8}
.cols{display:flex;gap:16px;align-items:flex-start}.cols>div{flex:1;min-width:0}
.kpi{display:grid;grid-template-columns:repeat(4,1fr);gap:6px;margin:8px 0}
.kpi div{border:1px solid #ddd;border-radius:4px;padding:4px 8px}.kpi b{display:block;font-size:17px}
img{max-width:100%}details{margin:6px 0}code{font-size:12px;word-break:break-all}
.row,.key{font-family:ui-monospace,monospace;font-size:12px}
.row{white-space:pre-wrap;word-break:break-word;border:1px solid #ddd;border-radius:4px;padding:6px;
margin:4px 0 10px;line-height:1.6}
.u{color:#666}.t{background:#c9f0cf;color:#000}
.sp{border:1px solid #7a5cc2;border-radius:3px;padding:0 2px;color:#5b3aa8;background:#f1ecfb;font-weight:600}
.sp.t{background:#c9f0cf}
"""


def mib(n: float | None) -> str:
    return "" if n is None or _nan(n) else f"{n / 2**20:,.1f} MiB"


def num(n: float | None, digits: int = 0) -> str:
    return "" if n is None or _nan(n) else f"{n:,.{digits}f}"


def secs(n: float | None) -> str:
    return "" if n is None or _nan(n) else f"{n:,.1f} s"


def _nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def banners(ctx: dict[str, Any]) -> list[str]:
    """Red or amber lines for what must not be missed: a skipped reference check, failed checks, near misses."""
    out = []
    skipped = ctx["reference_skipped"]
    if skipped:
        which = "every shard" if len(skipped) == len(ctx["reports"]) else f"shards {skipped}"
        out.append(
            f"<div class='banner bad'>Reference check SKIPPED on {which} (validate.reference: false or "
            "sample_rows: 0): the stored hidden states were never compared with a recomputation, so wrongly "
            "captured data would pass every other check. Rerun validation with the reference on before training.</div>"
        )
    failed = [(k, c["check"]) for k, v in enumerate(ctx["reports"]) for c in v.get("checks", []) if not c["ok"]]
    if failed:
        out.append(f"<div class='banner bad'>{len(failed)} failed check(s): {esc(str(failed[:8]))}</div>")
    worst = {lid: max((v for v in vals if v is not None), default=0.0) for lid, vals in ctx["margins"].items()}
    close = {lid: m for lid, m in worst.items() if NEAR_MISS <= m < 1.0}
    if close:
        out.append(
            f"<div class='banner warn'>Near the reference bound (worst error / bound ≥ {NEAR_MISS}): "
            + ", ".join(f"layer {lid}: {m:.2f}" for lid, m in close.items())
            + "</div>"
        )
    if (not_ok := [k for k, v in enumerate(ctx["reports"]) if not v.get("ok")]) and not failed:
        out.append(f"<div class='banner bad'>Validation did not pass on shards {not_ok}.</div>")
    if not out and len(ctx["reports"]) == len(ctx.get("dataset", {}).get("shards", ctx["reports"])):
        out.append(while_current(GREEN_BANNER))
    extra = set_aside_banner(ctx.get("set_aside", [])) + loss_banner(ctx.get("source_losses", []))
    return out + tool_banner(ctx.get("tool_quarantine")) + extra


def gate_banner(gate: dict[str, Any] | None) -> list[str]:
    """The overfit gate's verdict and the acceptance it saw (validate.overfit_gate), when it ran."""
    if not gate:
        return []
    verdict = str(gate.get("verdict", "?"))
    if verdict.startswith("skipped"):
        return [f"<div class='banner warn'>Overfit gate {esc(verdict)}</div>"]
    acc, bound = gate.get("acceptance") or {}, gate.get("bound") or {}
    per_pos = " ".join(f"{x:.2f}" for x in acc.get("acceptance_per_position", []))
    return [
        f"<div class='banner {'good' if gate.get('ok') else 'bad'}'>Overfit gate {esc(verdict.upper())}: a draft "
        f"overfit on the target's replies to {gate.get('served_equal_to_regenerated', '?')} prompts accepts "
        f"{num(acc.get('mean_acceptance_length'), 2)} tokens per step of {acc.get('max_acceptance_length', '?')} "
        f"(per position {per_pos}; bound ≥ {bound.get('min_acceptance_per_position', '?')} at each)</div>"
    ]


def kpis(ctx: dict[str, Any]) -> str:
    d, stats, t = ctx["dataset"], ctx["stats"], data.prepared_counts(ctx["counts"])["totals"]
    ok = sum(1 for v in ctx["reports"] if v.get("ok"))
    worst = [v for vals in ctx["margins"].values() for v in vals if v is not None]
    cov = ctx["coverage"]["at"]
    items = [
        ("rows in → rows out", f"{t['rows_in']:,} → {d['rows']:,}"),
        ("tokens (loss-masked share)", f"{d['tokens']:,} ({stats.get('assistant_token_share', 0):.1%})"),
        ("shards validated", while_current(f"{ok} / {len(ctx['reports'])}", "STALE: see the top of the page")),
        ("worst reference error / bound (below 1 passes)", f"{max(worst):.2f}" if worst else "not checked"),
        ("hidden states on disk", mib(d["bytes"])),
        ("layer ids (vLLM convention)", esc(str(d["layer_ids"]))),
        ("truncated rows", f"{stats.get('truncated_rows', 0):,} of {d['rows']:,}"),
        ("masked tokens a 32k draft vocab covers", f"{cov.get(32768, 0):.1%}"),
    ]
    return "<div class='kpi'>" + "".join(f"<div>{k}<b>{v}</b></div>" for k, v in items) + "</div>"


def funnel_table(steps: list[tuple[str, int | None, str]]) -> str:
    return _table(["step", "rows", "note"], [[esc(s), num(n), esc(note)] for s, n, note in steps], text=(0, 2)) + (
        "<p>Every quarantined record, with its file, line and reason: <code>results/prepared/quarantine.jsonl</code>, "
        "<code>results/tokenized/quarantine.jsonl</code>.</p>"
    )


def images_section(facts: dict[str, Any] | None) -> list[str]:
    """Rows with images, images per row, the vision tokens' share and the image quarantine reasons;
    no part at all for a run without images (not even an empty line), so its page keeps its bytes."""
    if facts is None:
        return []
    rows, n = facts["rows"], facts["images"]
    by_count = " · ".join(f"{k}: {v:,} row{'s' * (v != 1)}" for k, v in facts["rows_by_images"].items())

    def reasons(stage: str) -> str:
        named = facts["quarantined"][stage]
        return esc(", ".join(f"{r} {c:,}" for r, c in named.items())) if named else "none"

    table = [
        ["rows with images", f"{facts['image_rows']:,} of {rows:,} ({data.share(facts['image_rows'], rows)})"],
        ["images in them", f"{n:,} ({num(n / facts['image_rows'], 2) if facts['image_rows'] else 0} per image "
                           f"row; prepare kept {facts['prepare_images']:,})"],
        ["images per row", esc(by_count)],
        ["vision tokens (loss mask 0)", f"{facts['image_tokens']:,} ({facts['image_token_share']:.1%} of all tokens)"],
        ["quarantined for images by prepare", reasons("prepare")],
        ["quarantined for images by tokenize", reasons("tokenize")],
    ]  # fmt: skip
    return [
        "<h2>Images</h2>" + _table([], table, text=(0, 1))
        + "<p>The target's image processor decides each image's vision tokens; they are context for the "
        "replies, never trained on. The draft reads them as the target's hidden states at those tokens.</p>"
    ]  # fmt: skip


FIRST_SCREEN_SHARDS = 12  # beyond this, the first screen's shard table shows the spread instead


def shard_tokens_table(summary) -> str:
    total = max(int(summary["tokens"].sum()), 1)
    rows = [
        [str(r.shard), num(r.rows), num(r.tokens), f"{r.tokens / total:.1%}", mib(r.bytes)]
        for r in summary.itertuples()
    ]
    if len(rows) > FIRST_SCREEN_SHARDS:
        t = summary["tokens"]
        rows = [
            ["min", "", num(t.min()), f"{t.min() / total:.1%}", mib(summary["bytes"].min())],
            ["median", "", num(t.median()), f"{t.median() / total:.1%}", mib(summary["bytes"].median())],
            ["max", "", num(t.max()), f"{t.max() / total:.1%}", mib(summary["bytes"].max())],
            [f"all {len(rows)}", num(summary["rows"].sum()), num(total), "100%", mib(summary["bytes"].sum())],
        ]
    return _table(["shard", "rows", "tokens", "share", "on disk"], rows, text=())


def check_grid_table(columns: list[str], grid: list[list[tuple[str, str]]]) -> str:
    head = "<tr><th>shard</th>" + "".join(f"<th>{esc(c)}</th>" for c in columns) + "</tr>"
    body = "".join(
        f"<tr><td>{k}</td>"
        + "".join(f"<td class='{v}' title='{esc(tip)}'>{'✓' if v == 'ok' else esc(v)}</td>" for v, tip in row)
        + "</tr>"
        for k, row in enumerate(grid)
    )
    return f"<table>{head}{body}</table>"


def shard_table(summary) -> str:
    rows = []
    for r in summary.itertuples():
        margin = r.reference_worst_margin
        rows.append(
            [
                str(r.shard),
                num(r.rows),
                num(r.tokens),
                mib(r.bytes),
                secs(r.job_s),
                secs(r.engine_start_s),
                num(r.tokens_per_s),
                num(r.job_tokens_per_s),
                "ok" if r.validation_ok else "FAIL",
                "skipped" if margin is None or _nan(margin) else f"{margin:.2f}",
                esc(str(r.capture_path)),
            ]
        )
    header = ["shard", "rows", "tokens", "on disk", "job", "engine start", "capture tokens/s",
              "job tokens/s", "checks", "ref. error / bound", "capture path"]  # fmt: skip
    return _table(header, rows, text=(10,))


def template_kwargs_cell(kwargs: dict[str, Any] | None) -> str:
    """stats.json's chat_template_kwargs for the provenance table; None: a run made before the key existed."""
    if kwargs is None:
        return "not recorded"
    if not kwargs:
        return "none (the template's defaults)"
    return f"<code>{esc(json.dumps(kwargs, ensure_ascii=False))}</code>"


def provenance_table(ctx: dict[str, Any]) -> str:
    d = ctx["dataset"]
    m, tok, eng = d["model"], d["tokenizer"], d["engine"]
    export = ctx["export"]
    if export is None:
        export_line = "not requested (export.speculators: false)"
    else:
        export_line = f"ran: {export['rows']:,} rows, {mib(export['bytes'])} in {esc(export['dir'])}"
    rows = [
        ("model", f"<code>{esc(str(m.get('path')))}</code> {esc(str(m.get('architectures')))}"),
        ("model config sha256", f"<code>{esc(str(m.get('config_sha256')))}</code>"),
        ("weights sha256", f"<code>{esc(str(m.get('weights_sha256')))}</code>"),
        ("tokenizer sha256", f"<code>{esc(str(tok.get('tokenizer_sha256')))}</code>"),
        ("chat template sha256", f"<code>{esc(str(tok.get('chat_template_sha256')))}</code>"),
        ("chat template kwargs", template_kwargs_cell(ctx["stats"].get("chat_template_kwargs"))),
        ("loss mask from", esc(str(ctx["stats"].get("mask_source")))),
        (
            "engine",
            esc(
                f"{eng.get('engine')} {eng.get('engine_version', '')}, capture path {eng.get('capture_path')}, "
                f"TP {eng.get('tp_size', 1)}"
            ),
        ),  # fmt: skip
        (
            "dtype, hidden size",
            esc(
                f"{d['dtype']}, {d['hidden_size']} ({d['num_hidden_layers']} layers)"
                + (f", stored as {storage_format(d['storage']['name']).summary}" if d.get("storage") else "")
            ),
        ),
        ("code version", esc(", ".join(sorted(ctx["code_versions"])))),
        *reference_rows(ctx),
        ("speculators export", export_line),
        ("sources", esc(", ".join(map(str, d.get("sources") or [])))),
    ]
    return _table([], [[k, v] for k, v in rows], text=(0, 1))


def reference_rows(ctx: dict[str, Any]) -> list[tuple[str, str]]:
    """Provenance of validation: which run is the reference and which the floor run (whose error sets the bound);
    one line when no row was recomputed."""
    runs = data.reference_runs(ctx["reports"])
    if runs is None:
        return [("validation reference", esc(ctx["reference_line"]))]
    reference, floor = runs
    skipped = ctx.get("reference_skipped")
    return [
        ("validation reference", esc(reference + (f"; SKIPPED on shards {skipped}" if skipped else ""))),
        ("validation floor run", esc(floor)),
    ]


def coverage_table(cov: dict[str, Any]) -> str:
    head = [f"top {n // 1024}k ids" for n in cov["at"]]
    return _table(head, [[f"{s:.2%}" for s in cov["at"].values()]], text=()) + (
        f"<p>{cov['distinct_ids']:,} distinct ids among {cov['masked_tokens']:,} loss-masked tokens. "
        "A draft vocabulary of n ids can predict at most this share of the training targets.</p>"
    )


def all_checks(reports: list[dict[str, Any]]) -> str:
    parts = []
    for k, v in enumerate(reports):
        rows = [[esc(c["check"]), "ok" if c["ok"] else "FAIL", esc(c.get("detail", ""))] for c in v.get("checks", [])]
        parts.append(f"<h3>shard {k}</h3>" + _table(["check", "verdict", "detail"], rows, text=(0, 1, 2)))
    return "<details><summary>Every check of every shard, with its detail</summary>" + "".join(parts) + "</details>"


def margin_note(margins: dict[str, list[float | None]]) -> str:
    """What the margin figure's numbers are, in one paragraph under it."""
    from ..validate.passrule import FLOOR_FACTOR

    return (
        "<p>Per layer and shard, the sampled row nearest its bound: its error (RMS over the row's tokens of "
        "|captured − reference| / |reference|, the reference recomputed in fp32) divided by that row's own "
        f"bound (at least {FLOOR_FACTOR:g}× the error of transformers at the capture's precision on the same row). "
        f"Below 1 passes; {1 / FLOOR_FACTOR:g} means the capture equals that floor run exactly. Each shard's "
        "validation detail (at the bottom) names the row and both figures.</p>"
    )


def quality_note(doc: Path | None = None) -> str:
    """What a validation pass has been shown to mean for a draft, linked to the measurement."""
    doc = doc or Path(__file__).resolve().parents[3] / "docs/evidence.md"  # the repository's, when run from it
    name = f"<a href='{esc(doc.as_uri())}'>docs/evidence.md</a>" if doc.exists() else "docs/evidence.md"
    return (
        "<p class='note'>What a pass means for a draft: on the quality bench, EAGLE-3 drafts trained on "
        "validated rows were accepted by their target when vLLM served them, as often as drafts trained on "
        "the peer pipeline's rows; validation failed every planted mistake on every row, two of which lowered "
        "acceptance and one of which (the post-norm final state) acceptance could not tell. "
        f'The measurement: {name} ("Draft quality") in the eagle3prep repository.</p>'
    )


def sample_rows(items: list, note: str) -> str:
    """Sample rows as text: trained tokens (loss_mask 1) green, the rest grey, template tokens boxed."""
    if not items:
        return "<p>No row with both trained and untrained tokens among the first rows of the shards.</p>"
    parts = [
        "<p>A few rows from different shards, as the trainer sees them: <span class='key t'>trained on "
        "(loss_mask 1)</span> · <span class='key u'>context only (loss_mask 0)</span> "
        "· <span class='key sp'>special / template token</span>."
        + (f" Shown as token ids: {esc(note)}." if note else "")
        + "</p>"
    ]
    for s in items:
        cut = ""
        if s.start or s.end < s.seq_len:
            cut = f"; tokens {s.start:,}–{s.end - 1:,} shown"
        if s.at_cap:
            cut += "; as long as max_seq_len (its end may be cut)"
        head = (
            f"shard {s.shard}, row {s.row:,} (id <code>{esc(s.id[:16])}</code>): {s.seq_len:,} tokens, "
            f"{s.trained:,} trained{cut}"
        )
        spans = "".join(
            f"<span class='{'sp ' if special else ''}{'t' if trained else 'u'}'>{esc(text)}</span>"
            for text, trained, special in s.segments
        )
        parts.append(f"<p>{head}</p><div class='row'>{spans}</div>")
    return "".join(parts)


def img(title: str, png: str) -> str:
    return f"<img alt='{esc(title)}' src='data:image/png;base64,{png}'>"


def write_page(path: str, ctx: dict[str, Any], figs: dict[str, str]) -> None:
    """The whole page; `ctx` holds the dataset manifest, the tables' data and the validation reports."""
    d = ctx["dataset"]
    cols, grid = ctx["grid"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>eagle3prep report</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>eagle3prep dataset report</h1>",
        f"<p>{d['rows']:,} rows, {d['tokens']:,} tokens in {len(d['shards'])} shard{'s' * (len(d['shards']) != 1)} of "
        f"<code>{esc(str(d['model'].get('path')))}</code> hidden states, layer ids {esc(str(d['layer_ids']))}, "
        f"{esc(d['dtype'])}.</p>",
        *banners(ctx),
        *gate_banner(ctx.get("overfit_gate")),
        kpis(ctx),
        "<div class='cols'><div><h2>Rows: sources → training rows</h2>",
        funnel_table(ctx["funnel"]),
        "</div><div style='flex:0 0 auto'><h2>Tokens per shard</h2>",
        shard_tokens_table(ctx["summary"]),
        "</div></div>",
        source_table(ctx.get("source_losses", [])),
        *images_section(ctx.get("images")) + drafts.drafts_section(d),
        "<h2>Validation: every check per shard (hover a cell for its detail)</h2>",
        while_current("", STALE_VERDICTS) + check_grid_table(cols, grid),
        img("reference margin", figs["margin"]) if figs.get("margin") else "<p>No reference comparison ran.</p>",
        margin_note(ctx["margins"]) if figs.get("margin") else "",
        quality_note(),
        "<h2>Sample rows: what is trained on</h2>",
        sample_rows(ctx.get("samples", []), ctx.get("samples_note", "")),
        "<h2>Hidden-state statistics per layer and shard</h2>",
        img("layer statistics", figs["layer_stats"]),
        f"<p>{esc(ctx['outlier_note'])}</p>",
        "<h2>Draft-vocabulary coverage</h2>",
        coverage_table(ctx["coverage"]),
        img("vocabulary coverage", figs["coverage"]),
        "<h2>Shards</h2>",
        shard_table(ctx["summary"]),
        img("throughput and disk", figs["throughput"]),
        "<h2>Rows</h2>",
        img("distributions", figs["distributions"]),
        "<h2>Provenance</h2>",
        provenance_table(ctx),
        all_checks(ctx["reports"]),
        "</body></html>",
    ]
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
