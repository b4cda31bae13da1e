"""Keep an old report from reading as the truth after a run that did not rebuild it: a red banner at its top
names what changed since it was written (a failed or changed validation, a failed run), and set-aside shards
under results/failed/ are listed for the report's own banner.

The report job runs only when every shard validated, so a failed validation leaves the last report on disk; it
is marked here, by the heal job for what healing found and by the main Snakemake process in `onerror` for what
failed during the run. A rebuilt report has no mark.
"""

from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path

from ..check import report_failures
from ..paths import FAILED, REPORT, SET_ASIDE_VERDICT

MARK_START, MARK_END = "<!--eagle3prep:stale-->", "<!--/eagle3prep:stale-->"
SHOWN = 8  # reasons listed in the banner; the rest are counted
# What says "passed" on the page (the green banner, the count of shards validated) is written inside these marks
# with what to show instead once the report is stale: marked stale, no green is left beside the red banner.
PASS_START, PASS_END = "<!--eagle3prep:pass:", "<!--/eagle3prep:pass-->"
_PASS = re.compile(re.escape(PASS_START) + "(.*?)-->.*?" + re.escape(PASS_END), flags=re.S)


GREEN_BANNER = "<div class='banner good'>Every check passed on every shard, the reference check included.</div>"
STALE_VERDICTS = (
    "<p class='banner bad'>STALE: the verdicts below are from before the changes named at the top of the page, not "
    "the shards' current state.</p>"
)


def while_current(shown: str, when_stale: str = "") -> str:
    """`shown` (HTML) as long as the report is current; `when_stale` (HTML without "--") once mark_stale ran."""
    if "--" in when_stale:
        raise ValueError(f"{when_stale!r} cannot go inside an HTML comment")
    return f"{PASS_START}{when_stale}-->{shown}{PASS_END}"


def mark_stale(reasons: list[str], report: str | os.PathLike = REPORT) -> bool:
    """Put (or replace) the stale banner at the top of the report, first on the page, and take away what says
    passed (while_current); False when there is no report to mark."""
    path = Path(report)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return False
    text = re.sub(re.escape(MARK_START) + ".*?" + re.escape(MARK_END), "", text, flags=re.S)
    text = _PASS.sub(lambda m: m.group(1), text)
    shown = "".join(f"<li>{html.escape(r)}</li>" for r in reasons[:SHOWN])
    more = f"<li>... and {len(reasons) - SHOWN} more</li>" if len(reasons) > SHOWN else ""
    banner = (
        f"{MARK_START}<div class='banner bad'>STALE: this report was written before the changes below and was not "
        f"rebuilt; do not train on the data until a run ends with exit status 0 and rebuilds it.<ul>{shown}{more}"
        f"</ul></div>{MARK_END}"
    )
    at = text.find("<body>")
    at = at + len("<body>") if at >= 0 else 0
    from ..infra.atomic import atomic_open

    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text[:at] + banner + text[at:])
    return True


def is_stale(report: str | os.PathLike = REPORT) -> bool:
    try:
        return MARK_START in Path(report).read_text(encoding="utf-8")
    except OSError:
        return False


def set_aside_shards(failed: str | os.PathLike = FAILED) -> list[dict[str, str]]:
    """Each set-aside copy under results/failed/ (shard_k, shard_k.1, ...) and the checks its kept validation
    report (paths.SET_ASIDE_VERDICT) records failed: [{"dir", "why"}], sorted by name."""
    try:
        names = sorted(e.name for e in os.scandir(failed) if e.is_dir() and e.name.startswith("shard_"))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        try:
            report = json.loads((Path(failed) / name / SET_ASIDE_VERDICT).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            report = None
        why = report_failures(report) or "failed validation"
        out.append({"dir": f"{Path(failed) / name}", "why": why[:300]})
    return out


def mark_for_heal(reasons: list[str]) -> str | None:
    """What healing says when it marks the report stale for the shards it redoes; None when there is no report."""
    return f"marked {REPORT} STALE until this run rebuilds it" if mark_stale(reasons) else None
