"""Input formats: JSONL, JSON (a top-level list), parquet and Hugging Face `save_to_disk` folders, each read
as a stream of RawRecord rows. Line numbers are 1-based (JSONL line, JSON list element, parquet/dataset row + 1).
Also the source list: globs expanded and every file checked before anything is read."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3prep.prepare.errors import InputError, keys_preview

BATCH_ROWS = 1024  # rows per parquet / Arrow batch: bounds memory to one batch, not one file
PREFIX_BYTES = 1024  # how much of an over-long line is kept in the quarantine record


@dataclass(slots=True)
class RawRecord:
    """One row as a reader yields it: a parsed record, or a rejection the reader already made."""

    line: int  # 1-based
    record: Any = None
    reason: str | None = None
    detail: str = ""


class JsonlReader:
    """One JSON record per line, streamed; blank lines are skipped (and counted), not rows."""

    format = "jsonl"

    def __init__(self, max_line_bytes: int):
        self.max_line_bytes = max_line_bytes
        self.blank_lines = 0

    def read(self, path: str) -> Iterator[RawRecord]:
        """The file's rows; a line is read at most max_line_bytes at a time, so a huge line cannot fill memory."""
        self.blank_lines = 0
        lineno = 0
        try:
            with _open_binary(path) as f:
                while chunk := f.readline(self.max_line_bytes + 1):
                    lineno += 1
                    if lineno == 1 and chunk.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte order mark
                        chunk = chunk[3:]
                    if not chunk.endswith(b"\n") and len(chunk) > self.max_line_bytes:
                        yield self._too_long(f, chunk, lineno)
                        continue
                    yield from self._parse(chunk.removesuffix(b"\n"), lineno)
        except OSError as e:
            raise InputError(f"{path}: read failed at line {lineno + 1} ({e.strerror or e})") from None

    def _too_long(self, f, chunk: bytes, lineno: int) -> RawRecord:
        """Skip the rest of an over-long line; the row quarantines it with its size and first PREFIX_BYTES."""
        size = len(chunk)
        while more := f.readline(1 << 20):  # skip the rest of the line without holding it
            if more.endswith(b"\n"):
                size += len(more) - 1
                break
            size += len(more)
        return RawRecord(
            lineno,
            chunk[:PREFIX_BYTES].decode("utf-8", errors="replace"),
            "line_too_long",
            f"line is {size} bytes, over data.max_line_bytes = {self.max_line_bytes}; "
            f"record holds its first {PREFIX_BYTES} bytes",
        )

    def _parse(self, body: bytes, lineno: int) -> Iterator[RawRecord]:
        """One line as a row (parsed, or rejected as invalid_utf8 / invalid_json); nothing for a blank line."""
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            yield RawRecord(
                lineno,
                body.decode("utf-8", errors="backslashreplace"),
                "invalid_utf8",
                f"{e.reason} at byte {e.start} of the line",
            )
            return
        if not text.strip():
            self.blank_lines += 1
            return
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            yield RawRecord(lineno, text, "invalid_json", f"{e.msg.removesuffix(' at')} at column {e.colno}")
            return
        except RecursionError:
            yield RawRecord(lineno, text[:PREFIX_BYTES], "invalid_json", "JSON nested too deeply to parse")
            return
        yield RawRecord(lineno, record)


class JsonReader:
    """A JSON file holding one top-level list of records (read whole: one file's worth)."""

    format = "json"

    def read(self, path: str) -> Iterator[RawRecord]:
        """The list's elements as rows; a file that is not such a list is an InputError, not a quarantine."""
        with _open_binary(path) as f:
            data = f.read()
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise InputError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if not text.strip():
            return
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            hint = " (a file of one JSON record per line must be named .jsonl)" if e.msg == "Extra data" else ""
            # json ends some messages with "at" ("Unterminated string starting at"): the position is said first
            msg = e.msg.removesuffix(" at") + (" there" if e.msg.endswith(" at") else "")
            raise InputError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {msg}{hint}") from None
        except RecursionError:
            raise InputError(f"{path}: JSON nested too deeply to parse") from None
        if not isinstance(records, list):
            found = (
                f"an object with keys {keys_preview(records)}" if isinstance(records, dict) else type(records).__name__
            )
            raise InputError(
                f"{path}: expected a top-level JSON list of conversation records, found {found} "
                "(wrap a single record in [ ], or convert the file to JSONL)"
            )
        for i, record in enumerate(records):
            yield RawRecord(i + 1, record)


class ParquetReader:
    """A parquet file, streamed in row batches; the row number + 1 is the "line"."""

    format = "parquet"

    def read(self, path: str) -> Iterator[RawRecord]:
        """The file's rows, a batch of BATCH_ROWS at a time; an unreadable file is an InputError."""
        import pyarrow.parquet as pq

        if os.path.getsize(path) == 0:
            return
        try:
            pf = pq.ParquetFile(path)
            row = 0
            for batch in pf.iter_batches(batch_size=BATCH_ROWS):
                for record in batch.to_pylist():
                    row += 1
                    yield RawRecord(row, record)
        except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid / ArrowIOError derive from these
            raise InputError(f"{path}: cannot read as parquet ({_one_line(e)})") from None


class HFDiskReader:
    """A Hugging Face `datasets` folder written by `Dataset.save_to_disk`, streamed in Arrow batches."""

    format = "hf_dataset"

    @staticmethod
    def check(path: str) -> None:
        """Raise InputError unless `path` looks like one saved Dataset (cheap: no import)."""
        p = Path(path)
        if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
            return
        if (p / "dataset_dict.json").is_file():
            splits = sorted(c.name for c in p.iterdir() if (c / "state.json").is_file())
            raise InputError(
                f"{path}: is a DatasetDict (splits: {', '.join(splits) or 'none'}); "
                f"list one split folder as a source, e.g. {p / _suggested_split(splits)}"
            )
        found = sorted(c.name for c in p.iterdir())
        shown = ", ".join(found[:8]) + (", ..." if len(found) > 8 else "") if found else "nothing"
        raise InputError(
            f"{path}: is a folder but not a Hugging Face dataset saved with save_to_disk "
            f"(expected state.json and dataset_info.json in it; found {shown})"
        )

    def read(self, path: str) -> Iterator[RawRecord]:
        """The dataset's rows, a batch of BATCH_ROWS at a time; needs the optional `datasets` package."""
        self.check(path)
        try:
            import datasets
        except ImportError:
            raise InputError(
                f"{path}: reading a save_to_disk folder needs the `datasets` package "
                "(pip install datasets, or pip install eagle3prep[hfdatasets])"
            ) from None
        try:
            ds = datasets.load_from_disk(path)
            row = 0
            for table in ds.with_format("arrow").iter(batch_size=BATCH_ROWS):
                for record in table.to_pylist():
                    row += 1
                    yield RawRecord(row, record)
        except (OSError, ValueError) as e:
            raise InputError(f"{path}: cannot read as a Hugging Face dataset ({_one_line(e)})") from None


READERS = {".jsonl": JsonlReader, ".ndjson": JsonlReader, ".json": JsonReader, ".parquet": ParquetReader}


def reader_for(path: str, max_line_bytes: int):
    """The reader for one expanded source path (checked before anything is read)."""
    if os.path.isdir(path):
        HFDiskReader.check(path)
        return HFDiskReader()
    suffix = Path(path).suffix.lower()
    if suffix not in READERS:
        raise InputError(
            f"{path}: unsupported file type '{suffix or '(none)'}' "
            "(expected .jsonl, .ndjson, .json, .parquet or a save_to_disk folder)"
        )
    if not os.path.isfile(path):  # reading a FIFO or a device would block or never end
        raise InputError(
            f"{path}: is not a regular file (a FIFO, socket or device?); list a file or a save_to_disk folder"
        )
    if not os.access(path, os.R_OK):
        raise InputError(f"{path}: file is not readable (check its permissions)")
    return JsonlReader(max_line_bytes) if READERS[suffix] is JsonlReader else READERS[suffix]()


def expand_sources(sources: list[str]) -> list[str]:
    """Expand globs (each sorted), keep the given order, drop repeats; raise on a missing source."""
    if not sources:
        raise InputError("data.sources is empty; list at least one file, glob or save_to_disk folder")
    files: list[str] = []
    listed: set[str] = set()
    for source in sources:
        if glob.has_magic(source):
            matches = sorted(glob.glob(source, recursive=True))
            if not matches:
                raise InputError(f"data.sources: pattern '{source}' matches no files")
        elif os.path.exists(source):
            matches = [source]
        else:
            raise InputError(f"data.sources: '{source}' does not exist (cwd: {os.getcwd()})")
        for m in matches:
            if m not in listed:  # a file named twice (overlapping globs) is read once, at its first place
                listed.add(m)
                files.append(m)
    return files


def _open_binary(path: str):
    """`path` opened for reading bytes, or InputError with the OS's reason."""
    try:
        return open(path, "rb")
    except OSError as e:
        raise InputError(f"{path}: cannot open ({e.strerror})") from None


def _one_line(e: BaseException) -> str:
    """An exception's message on one line, for an InputError that names the file."""
    return " ".join(str(e).split()) or type(e).__name__


def _suggested_split(splits: list[str]) -> str:
    """The split a DatasetDict hint names: the training one when there is one (the sorted first is often `test`)."""
    for name in ("train", "train_sft", "training"):
        if name in splits:
            return name
    return next((s for s in splits if s.startswith("train")), splits[0] if splits else "train")
