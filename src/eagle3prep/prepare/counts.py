"""Row accounting: per-file counts (every input row is kept, a duplicate, or quarantined), counts.json, the
check that the numbers add up, the log summary, and the tokenize job's stop when nothing was kept."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from eagle3prep.prepare.errors import IMAGE_REASONS, REASONS, NoConversationsError

MAX_LISTED_DUPLICATES = 1000  # counts.json lists at most this many duplicate rows (all are counted)
MAX_NAMED_FILES = 5  # require_conversations names at most this many source files


@dataclass(slots=True)
class FileCounts:
    """What became of one source file's rows; `to_json` is its entry in counts.json."""

    file: str
    format: str
    rows_in: int = 0
    kept: int = 0
    duplicates: int = 0
    blank_lines: int = 0  # JSONL only; not rows
    quarantined: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    images: int = 0  # image parts in the kept conversations

    def to_json(self, with_images: bool = False) -> dict[str, Any]:
        """Its counts.json entry; `with_images` (a run that met an image): the image reasons and image count too."""
        reasons = (*REASONS, *IMAGE_REASONS) if with_images else REASONS
        return {
            "file": self.file,
            "format": self.format,
            "rows_in": self.rows_in,
            "kept": self.kept,
            "duplicates": self.duplicates,
            **({"images": self.images} if with_images else {}),
            "quarantined": {r: self.quarantined.get(r, 0) for r in reasons},
            "quarantined_total": sum(self.quarantined.values()),
            "blank_lines": self.blank_lines,
        }


def counts_json(
    sources, max_line_bytes, per_file: list[FileCounts], duplicate_rows, with_images: bool = False
) -> dict[str, Any]:
    """counts.json: {sources, max_line_bytes, files: [per file], totals, duplicate_rows[, _truncated]}.
    `with_images`: the run met an image, so each entry also counts images and lists the image reasons."""
    files = [fc.to_json(with_images) for fc in per_file]
    keys = ("rows_in", "kept", "duplicates", *(["images"] if with_images else []), "quarantined_total", "blank_lines")
    totals: dict[str, Any] = {k: sum(f[k] for f in files) for k in keys}
    totals["quarantined"] = (
        {r: sum(f["quarantined"][r] for f in files) for r in files[0]["quarantined"]}
        if files
        else {r: 0 for r in REASONS}
    )
    totals["files"] = len(files)
    return {
        "sources": list(sources),
        "max_line_bytes": max_line_bytes,
        "files": files,
        "totals": totals,
        "duplicate_rows": duplicate_rows,  # first MAX_LISTED_DUPLICATES; `id` finds the kept first copy
        "duplicate_rows_truncated": totals["duplicates"] > len(duplicate_rows),
    }


def check_invariant(counts: dict[str, Any], written: dict[str, int] | None = None, stage: str = "prepare") -> None:
    """Raise unless rows_in == kept + duplicates + quarantined for every file and in total. `stage` names the
    stage whose counts these are (the regenerate stage keeps its counts in the same shape)."""
    for c in [*counts["files"], counts["totals"]]:
        name = c.get("file", "totals")
        q = sum(c["quarantined"].values())
        if q != c["quarantined_total"] or c["rows_in"] != c["kept"] + c["duplicates"] + q:
            raise RuntimeError(
                f"{stage}: row accounting broken for {name}: rows_in={c['rows_in']} != kept={c['kept']} "
                f"+ duplicates={c['duplicates']} + quarantined={q} (a bug in eagle3prep.{stage}; please report it)"
            )
    t = counts["totals"]
    if written is not None and (written["conversations"], written["quarantine"]) != (
        t["kept"],
        t["quarantined_total"],
    ):
        raise RuntimeError(f"{stage}: lines written {written} do not match counts {t} (a bug in eagle3prep.{stage})")


def summarize(counts: dict[str, Any]) -> str:
    """A few human-readable lines for the log: one per file and the totals."""

    def line(name: str, c: dict[str, Any]) -> str:
        reasons = ", ".join(f"{r} {n}" for r, n in c["quarantined"].items() if n)
        return (
            f"{name}: {c['rows_in']} rows in, {c['kept']} kept, {c['duplicates']} duplicates, "
            f"{c['quarantined_total']} quarantined" + (f" ({reasons})" if reasons else "")
        )

    lines = [
        line(f"{f['file']} [{f['format']}]", f) + (" (empty)" if not f["rows_in"] else "") for f in counts["files"]
    ]
    lines.append(line(f"total over {counts['totals']['files']} files", counts["totals"]))
    return "\n".join(lines)


def require_conversations(counts_path: str | os.PathLike, quarantine_path: str | os.PathLike) -> None:
    """Raise NoConversationsError unless the prepare stage kept at least one conversation. Called by the
    tokenize job, not by prepare, so that prepare's quarantine survives (DESIGN.md §3 says why)."""
    with open(counts_path, encoding="utf-8") as f:
        counts = json.load(f)
    if not counts["totals"]["kept"]:
        if counts.get("stage") == "regenerate":  # the regenerate stage's counts.json, in the same shape
            raise NoConversationsError(_none_regenerated_message(counts, quarantine_path))
        raise NoConversationsError(_no_conversations_message(counts, quarantine_path))


def _none_regenerated_message(counts: dict[str, Any], quarantine_path: str | os.PathLike) -> str:
    """One line: the regenerate stage quarantined every conversation; its reasons and where they are."""
    t = counts["totals"]
    reasons = ", ".join(f"{r} {n}" for r, n in t["quarantined"].items() if n)
    return (
        f"no conversations to tokenize: regenerate quarantined all {_plural(t['rows_in'], 'conversation')} "
        f"({reasons}); each conversation and its reason is in {quarantine_path}"
    )


def _no_conversations_message(counts: dict[str, Any], quarantine_path: str | os.PathLike) -> str:
    """One line: the sources (with their sizes) and, when they held records, every quarantine reason."""
    t = counts["totals"]

    def size(f: dict[str, Any]) -> str:
        if f["rows_in"]:
            return _plural(f["rows_in"], "record")
        return f"only {_plural(f['blank_lines'], 'blank line')}" if f["blank_lines"] else "empty"

    files = counts["files"]
    named = ", ".join(f"{f['file']} ({size(f)})" for f in files[:MAX_NAMED_FILES])
    if len(files) > MAX_NAMED_FILES:
        named += f" and {len(files) - MAX_NAMED_FILES} more files"
    if not t["rows_in"]:
        return (
            f"no conversations to tokenize: data.sources hold no records: {named}; "
            "list files that contain conversations in data.sources"
        )
    # In the order prepare checks them (counts.json's keys are sorted).
    reasons = ", ".join(f"{r} {n}" for r in (*REASONS, *IMAGE_REASONS) if (n := t["quarantined"].get(r)))
    return (
        f"no conversations to tokenize: prepare quarantined all {_plural(t['rows_in'], 'record')} ({reasons}) "
        f"of {files[0]['file'] if len(files) == 1 else named}; each record and its reason is in {quarantine_path}"
    )


def _plural(n: int, word: str) -> str:
    """`n` and `word`, with an "s" unless n is 1."""
    return f"{n} {word}{'' if n == 1 else 's'}"


LOSS_SETTING = "data.max_quarantine_share"


def loss_error(counts: dict[str, Any], max_share: float, kept_copy: str | os.PathLike) -> str | None:
    """One line when a source file holds no record (empty_error), lost every row, or more than `max_share` of its rows, to quarantine; None
    otherwise. Such a file was misread (other column names, another chat shape), not a few bad records, and a run
    that drops it in silence trains on a dataset the user did not ask for. `kept_copy`: where the quarantine is kept
    for study (the job's own outputs are removed when it fails)."""
    if empty := [f for f in counts["files"] if not f["rows_in"]]:
        return empty_error(empty)
    lossy = [
        f
        for f in counts["files"]
        if f["rows_in"] and f["quarantined_total"] and (
            f["quarantined_total"] == f["rows_in"] or f["quarantined_total"] / f["rows_in"] > max_share
        )
    ]  # fmt: skip
    if not lossy:
        return None
    f = lossy[0]
    reasons = ", ".join(f"{r} {n}" for r, n in f["quarantined"].items() if n)
    lost = "all" if f["quarantined_total"] == f["rows_in"] else f"{f['quarantined_total'] / f['rows_in']:.0%}"
    more = f" (and {len(lossy) - 1} more file{'s' * (len(lossy) > 2)}: {', '.join(g['file'] for g in lossy[1:3])}" + (
        ", ...)" if len(lossy) > 3 else ")"
    )
    # A file that loses every row fails whatever the share: raising it is offered only when it would pass.
    partial = all(g["quarantined_total"] < g["rows_in"] for g in lossy)
    over = f"over {LOSS_SETTING} = {max_share:g}" if partial else (
        f"a file that loses every row fails whatever {LOSS_SETTING} is (now {max_share:g})"
    )  # fmt: skip
    return (
        f"{f['file']}: prepare quarantined {f['quarantined_total']} of its {_plural(f['rows_in'], 'row')} ({lost}; "
        f"{reasons}), {over}{more if len(lossy) > 1 else ''}; each record and its "
        f"reason is in {kept_copy}: fix the file{',' if partial else ' or'} drop it from data.sources"
        + (f", or raise {LOSS_SETTING}" if partial else "")
    )


def empty_error(empty: list[dict[str, Any]]) -> str:
    """One line naming the source files that hold no record (empty, or blank lines only): a listed source that gives
    nothing was not what the user meant to train on, and `0 rows in, 0 kept` passed it in silence."""
    f = empty[0]
    what = f"only {_plural(f['blank_lines'], 'blank line')}" if f.get("blank_lines") else "an empty file"
    more = f" (and {len(empty) - 1} more: {', '.join(g['file'] for g in empty[1:3])}{', ...' * (len(empty) > 3)})"
    return (
        f"{f['file']}: no records ({what}){more if len(empty) > 1 else ''}; a source file must hold conversations: "
        "fix the file or drop it from data.sources"
    )


def check_losses(counts: dict[str, Any], max_share: float, quarantine: str | os.PathLike,
                 log: str | os.PathLike) -> None:  # fmt: skip
    """Raise the one-line UserError of `loss_error` for a prepare job (`max_share`: data.max_quarantine_share),
    after copying the job's quarantine beside its log (a failed job loses its outputs)."""
    import shutil

    from eagle3prep.errors import UserError

    kept_copy = os.path.splitext(str(log))[0] + ".quarantine.jsonl"
    if error := loss_error(counts, float(max_share), kept_copy):
        shutil.copyfile(quarantine, kept_copy)
        raise UserError(error)


def loss_lines(counts: dict[str, Any], later: dict[str, dict[str, int]] | None = None) -> list[str]:
    """Per source file, rows in and rows kept, when any file lost rows to quarantine (else []). `later`: {file:
    {reason: rows}} that a later stage (tokenize) quarantined, named by the same reasons as the report's."""
    later = later or {}
    files = counts.get("files", [])
    if not any(f["quarantined_total"] for f in files) and not any(n for r in later.values() for n in r.values()):
        return []
    lines = []
    for f in files:
        after_reasons = {r: n for r, n in later.get(f["file"], {}).items() if n}
        after = sum(after_reasons.values())
        reasons = ", ".join(f"{r} {n}" for r, n in [*f["quarantined"].items(), *after_reasons.items()] if n)
        dup = f", {f['duplicates']} duplicates" if f["duplicates"] else ""
        lines.append(
            f"{f['file']}: {f['rows_in']:,} rows in, {f['kept'] - after:,} kept{dup}"
            + (f", {f['quarantined_total'] + after:,} quarantined ({reasons})" if reasons else "")
        )
    return lines
