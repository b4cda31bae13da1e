"""Parts of the page (page.py) built from plain data: the table every section uses, the rows lost per source file
(data.source_losses) and the banner for quarantined conversations with tool calls (data.tool_quarantine)."""

from __future__ import annotations

import html
from typing import Any

from . import data

esc = html.escape


def table(header: list[str], rows: list[list[str]], text: tuple[int, ...] = (0,)) -> str:
    """Cells are already escaped HTML; columns in `text` are left-aligned and wrap, numbers align right."""
    cls = lambda i: " class='l'" if i in text else ""  # noqa: E731
    head = "".join(f"<th{cls(i)}>{h}</th>" for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f"<td{cls(i)}>{c}</td>" for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table>{head and f'<tr>{head}</tr>'}{body}</table>"


def _num(n: int | None) -> str:
    return "" if n is None else f"{n:,}"


MAX_SOURCE_ROWS = 20  # source files listed; with more, those that lost the most rows


def source_table(rows: list[dict[str, Any]]) -> str:
    """Per source file: rows in, duplicates, each stage's quarantine with its reasons, rows out."""
    if not rows:
        return ""
    stages = list(dict.fromkeys(stage for r in rows for stage in r["lost"]))
    shown = rows
    if len(rows) > MAX_SOURCE_ROWS:
        lost = lambda r: (r["duplicates"] or 0) + sum(n for x in r["lost"].values() for n in x.values())  # noqa: E731
        shown = sorted(rows, key=lost, reverse=True)[:MAX_SOURCE_ROWS]
    body = [
        [esc(str(r["file"])), _num(r["rows_in"]), _num(r["duplicates"])]
        + [esc(", ".join(f"{reason} {n:,}" for reason, n in r["lost"].get(stage, {}).items())) for stage in stages]
        + [_num(r["rows_out"])]
        for r in shown
    ]
    header = ["source file", "rows in", "duplicates", *(f"quarantined by {s}" for s in stages), "rows out"]
    more = (
        f"<p>The {MAX_SOURCE_ROWS} of {len(rows)} files that lost the most rows; every file's counts: "
        "<code>counts.json</code> of the prepare stage.</p>"
        if len(shown) < len(rows)
        else ""
    )
    return "<h2>Rows lost per source file</h2>" + table(header, body, text=(0, *range(3, 3 + len(stages)))) + more


def tool_banner(tools: dict[str, Any] | None) -> list[str]:
    """An amber line when conversations with tool calls were quarantined: how many, by which stage and why (the
    first one's detail, where the stage's quarantine file was read)."""
    if not tools:
        return []
    parts = []
    for stage, reason, n, first in tools["stages"]:
        why = f"{first[1]}; the first from {first[0]}" if first else data.TOOL_REASONS[(stage, reason)]
        parts.append(f"{n:,} by {stage} as {reason} ({why})")
    n = tools["total"]
    were = "conversations with tool calls were" if n != 1 else "conversation with tool calls was"
    return [
        f"<div class='banner warn'>{n:,} {were} quarantined: {esc('; '.join(parts))}. None of them is in the "
        "training rows; each one, with its file and line, is in its stage's <code>quarantine.jsonl</code>.</div>"
    ]


def set_aside_banner(set_aside: list[dict[str, str]]) -> list[str]:
    """Shards that failed validation and were moved to results/failed/ (and extracted again): in red, beside the
    verdict on the shards in use, since the damage they show may come back."""
    if not set_aside:
        return []
    items = "".join(f"<li><code>{esc(s['dir'])}</code>: {esc(s['why'])}</li>" for s in set_aside)
    return [
        f"<div class='banner bad'>{len(set_aside)} shard cop{'ies' if len(set_aside) != 1 else 'y'} failed "
        f"validation and {'were' if len(set_aside) != 1 else 'was'} set aside (not in this dataset; the shard was "
        f"extracted again):<ul>{items}</ul></div>"
    ]


def loss_banner(losses: list[dict[str, Any]]) -> list[str]:
    """The source files that lost rows to quarantine, each with its rows in, rows kept, duplicates and quarantined
    rows by reason (so the numbers add up), in the words the end of a run prints (prepare.counts.loss_lines)."""
    lossy = [s for s in losses if any(n for reasons in s["lost"].values() for n in reasons.values())]
    if not lossy:
        return []

    def line(s: dict[str, Any]) -> str:
        reasons = ", ".join(f"{r} {n}" for stage in s["lost"].values() for r, n in stage.items() if n)
        kept = "?" if s["rows_out"] is None else f"{s['rows_out']:,}"
        rows_in = "?" if s["rows_in"] is None else f"{s['rows_in']:,}"
        dup = f", {s['duplicates']:,} duplicates" if s.get("duplicates") else ""
        lost = sum(n for stage in s["lost"].values() for n in stage.values())
        return (
            f"<li><code>{esc(str(s['file']))}</code>: {rows_in} rows in, {kept} kept{dup}, {lost:,} quarantined "
            f"({esc(reasons)})</li>"
        )

    return [
        f"<div class='banner warn'>Rows quarantined in {len(lossy)} source file{'s' * (len(lossy) != 1)} "
        f"(the table below gives each reason):<ul>{''.join(line(s) for s in lossy)}</ul></div>"
    ]
