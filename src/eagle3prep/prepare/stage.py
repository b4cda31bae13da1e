"""The prepare driver: every source read in order, each row sorted into kept / duplicate / quarantined and
written, then counts.json; the outputs appear together, atomically, or not at all."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self, TextIO

from eagle3prep.infra import faults
from eagle3prep.infra.atomic import atomic_open, write_json
from eagle3prep.infra.log import get_logger
from eagle3prep.prepare.counts import (
    MAX_LISTED_DUPLICATES,
    FileCounts,
    check_invariant,
    check_losses,
    counts_json,
    summarize,
)
from eagle3prep.prepare.errors import IMAGE_REASONS, Rejected
from eagle3prep.prepare.images import ImageOptions
from eagle3prep.prepare.normalize import conversation_digest, normalize, normalize_tools
from eagle3prep.prepare.readers import RawRecord, expand_sources, reader_for
from eagle3prep.records import Conversation, Quarantined

if TYPE_CHECKING:
    from eagle3prep.settings import DataSettings

log = get_logger("prepare")


@dataclass(frozen=True, slots=True)
class PreparePaths:
    """The prepare job's files (its sources are a setting, data.sources): the three outputs and the log, beside
    which a failed job's quarantine is kept."""

    out_conversations: str | os.PathLike
    out_quarantine: str | os.PathLike
    out_counts: str | os.PathLike
    log_path: str | os.PathLike


@dataclass(frozen=True, slots=True)
class PrepareJobSettings:
    """What the prepare job reads: `data:`, and `allow_prompt_only` (the regenerate stage's prepare): records
    without an assistant turn are kept, and images are quarantined as the stage cannot send them, with
    data.allow_no_user_turn off as before it."""

    data: DataSettings
    allow_prompt_only: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, allow_prompt_only: bool) -> Self:
        from eagle3prep.settings import DataSettings

        return cls(DataSettings.from_config(config), allow_prompt_only)


def run_prepare_job(paths: PreparePaths, settings: PrepareJobSettings) -> dict[str, Any]:
    """The prepare stage's job: data.sources read into the three outputs, a summary logged; a file that lost more
    than data.max_quarantine_share of its rows fails the job, its quarantine kept beside `log_path`."""
    data, prompt_only = settings.data, settings.allow_prompt_only
    counts = prepare(
        list(data.sources), paths.out_conversations, paths.out_quarantine, paths.out_counts,
        max_line_bytes=data.max_line_bytes,
        allow_no_user_turn=data.allow_no_user_turn and not prompt_only,
        allow_prompt_only=prompt_only,
        images=None if prompt_only else ImageOptions.of(data),
    )  # fmt: skip
    log.info(summarize(counts))
    check_losses(counts, data.max_quarantine_share, paths.out_quarantine, paths.log_path)
    return counts


def prepare(
    sources: list[str],
    out_conversations: str | os.PathLike,
    out_quarantine: str | os.PathLike,
    out_counts: str | os.PathLike,
    *,
    max_line_bytes: int,
    allow_no_user_turn: bool,
    allow_prompt_only: bool = False,
    images: ImageOptions | None = None,
) -> dict[str, Any]:
    """Read every source, write conversations / quarantine JSONL and counts JSON; return the counts.

    Args:
        sources: files, globs or save_to_disk folders, read in this order (globs sorted).
        out_conversations: JSONL of `Conversation.to_json()`, `source` = "path:line".
        out_quarantine: JSONL of `Quarantined.to_json()`.
        out_counts: JSON, layout in `counts.counts_json`.
        max_line_bytes: a longer JSONL line is quarantined as "line_too_long" without being parsed.
        allow_prompt_only: keep records without an assistant message instead of quarantining them as
            "no_assistant_turn" (only when the regenerate stage writes the replies).
        allow_no_user_turn: keep records without a user message instead of quarantining them as
            "no_user_turn" (data.allow_no_user_turn: completion-style data).
        images: read images in user messages (data.image_root, data.max_image_pixels); None: a record with an
            image is quarantined as "non_text_content" (the prompt-only prepare of the regenerate stage).
    """
    sources = [os.fspath(s) for s in sources]
    files = expand_sources(sources)
    readers = [reader_for(path, max_line_bytes) for path in files]  # fail on a bad source before reading
    with (
        atomic_open(out_conversations, "w", encoding="utf-8") as conv_f,
        atomic_open(out_quarantine, "w", encoding="utf-8") as quar_f,
    ):
        out = _Outputs(conv_f, quar_f, allow_no_user_turn, allow_prompt_only, images)
        per_file = [_prepare_file(path, reader, out) for path, reader in zip(files, readers, strict=True)]
        counts = counts_json(sources, max_line_bytes, per_file, out.duplicate_rows, out.met_images)
        check_invariant(counts, out.written)
        faults.kill_point("prepare.before_rename")
    write_json(out_counts, counts)
    return counts


def _prepare_file(path: str, reader, out: _Outputs) -> FileCounts:
    """Stream one source file's rows into `out`; return what became of them."""
    fc = FileCounts(path, reader.format)
    for raw in reader.read(path):
        fc.rows_in += 1
        faults.kill_point("prepare.mid_stream", file=os.path.basename(path), line=raw.line)
        out.add(fc, path, raw)
    fc.blank_lines = getattr(reader, "blank_lines", 0)
    return fc


@dataclass(slots=True)
class _Outputs:
    """The two JSONL outputs, and what spans files: the digests kept so far (exact duplicates are dropped
    after the first occurrence, in any file), the duplicates listed, and the lines written."""

    conv_f: TextIO
    quar_f: TextIO
    allow_no_user_turn: bool
    allow_prompt_only: bool = False
    images: ImageOptions | None = None
    met_images: bool = False  # a kept image or an image quarantine: counts.json then lists the image counts
    seen: set[bytes] = field(default_factory=set)  # sha256 digests of kept conversations (32 bytes each)
    duplicate_rows: list[dict[str, Any]] = field(default_factory=list)
    written: dict[str, int] = field(default_factory=lambda: {"conversations": 0, "quarantine": 0})

    def add(self, fc: FileCounts, path: str, raw: RawRecord) -> None:
        """Sort one row into kept, duplicate or quarantined: count it in `fc` and write it where it goes."""
        try:
            if raw.reason is not None:
                raise Rejected(raw.reason, raw.detail)
            messages = normalize(
                raw.record, self.allow_prompt_only, allow_no_user_turn=self.allow_no_user_turn, images=self.images
            )
            tools = normalize_tools(raw.record)
        except Rejected as r:
            fc.quarantined[r.reason] = fc.quarantined.get(r.reason, 0) + 1
            self.met_images |= r.reason in IMAGE_REASONS
            self.quar_f.write(quarantine_line(Quarantined(path, raw.line, r.reason, r.detail, raw.record)))
            self.written["quarantine"] += 1
            return
        digest = conversation_digest(messages, tools)
        if digest in self.seen:
            fc.duplicates += 1
            if len(self.duplicate_rows) < MAX_LISTED_DUPLICATES:
                self.duplicate_rows.append({"file": path, "line": raw.line, "id": digest.hex()})
            return
        self.seen.add(digest)
        fc.kept += 1
        n_images = sum(
            isinstance(m["content"], list) and sum(p["type"] == "image" for p in m["content"]) for m in messages
        )
        fc.images += n_images
        self.met_images |= n_images > 0
        conv = Conversation(digest.hex(), messages, f"{path}:{raw.line}", tools)
        self.conv_f.write(json.dumps(conv.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n")
        self.written["conversations"] += 1


def quarantine_line(q: Quarantined) -> str:
    """One JSON line; a raw record that is not JSON (bytes, NaN, dates from parquet) is kept as its repr."""
    try:
        line = json.dumps(q.to_json(), ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"
        line.encode("utf-8")  # a lone surrogate from a JSON escape cannot be written (UnicodeEncodeError)
        return line
    except (TypeError, ValueError):
        q.record = repr(q.record)
        return json.dumps(q.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n"
