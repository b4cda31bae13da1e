"""The `prepare` stage: raw chat files -> normalized conversations, quarantine, counts.

Reads JSONL, JSON (a top-level list), parquet files and Hugging Face `save_to_disk` folders, in the
order given (globs expanded, sorted). Each record is normalized to `Conversation.messages`
(`[{"role": system|user|assistant|tool, "content": str}]`) from the ShareGPT shape
(`conversations: [{from, value}]`) or the OpenAI shape (`messages: [{role, content}]`), or is
quarantined with one of `REASONS`. Tool calling is kept in the shape transformers' chat templates
render: an assistant message's `tool_calls: [{"type": "function", "function": {name, arguments}}]`
(from OpenAI `tool_calls`/`function_call` or a ShareGPT `function_call` turn), `role: tool` replies
(OpenAI `tool`/`function`, ShareGPT `observation`), and the record's `tools` schemas. Exact duplicates (same content hash) are dropped after the first
occurrence and counted. Every input row ends up in exactly one of kept / duplicates / quarantined,
and `prepare` raises if that does not add up.

Line numbers are 1-based everywhere (JSONL line, JSON list element, parquet/dataset row + 1);
`Quarantined.line == 0` means a whole file.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3prep import faults
from eagle3prep.atomic import atomic_open, write_json
from eagle3prep.errors import UserError
from eagle3prep.records import Conversation, Quarantined

DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024  # config/schema.yaml data.max_line_bytes
BATCH_ROWS = 1024  # rows per parquet / Arrow batch: bounds memory to one batch, not one file
PREFIX_BYTES = 1024  # how much of an over-long line is kept in the quarantine record
MAX_LISTED_DUPLICATES = 1000  # counts.json lists at most this many duplicate rows (all are counted)

# Quarantine reasons, in the order they are checked.
REASONS = (
    "line_too_long",  # JSONL line over max_line_bytes (not parsed)
    "invalid_utf8",  # JSONL line that is not UTF-8, or content with a lone surrogate ("\\ud800")
    "invalid_json",  # JSONL line that does not parse
    "unknown_shape",  # neither {"messages": [...]} nor {"conversations": [...]}, or a message not an object
    "missing_role",  # a message without role/from
    "unknown_role",  # a role outside ROLE_MAP and TOOL_CALL_ROLES
    "invalid_tool_call",  # a tool call without a function name, or tool calls / `tools` that are not JSON
    "empty_content",  # content missing, null, "" or whitespace only (and no tool call), or an empty list of parts
    "non_string_content",  # content neither a string nor a list of text parts
    "non_text_content",  # a list of parts with a non-text part (image, audio, ...)
    "misplaced_system",  # a system message anywhere but first
    "no_assistant_turn",  # no assistant message at all
)

ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",  # OpenAI tool replies
    "function": "tool",  # OpenAI's older function replies
    "observation": "tool",  # ShareGPT (LLaMA-Factory) tool replies
    "ipython": "tool",  # Llama 3.1's tool replies
}
# ShareGPT turns whose value is the assistant's tool call(s) as JSON: {"name", "arguments"} or a list of them.
TOOL_CALL_ROLES = ("function_call", "tool_call", "tool_calls")

# Container key -> (role key, content key). Either pair is accepted in either container, native first,
# because many datasets put {role, content} messages under "conversations".
SHAPES = {"messages": ("role", "content"), "conversations": ("from", "value")}


class InputError(UserError, ValueError):
    """A source that cannot be read at all; the message names the file (and line/field) and the fix."""


class NoConversationsError(InputError):
    """Prepare kept no conversation: the sources are empty, or every record in them was quarantined."""


class Rejected(Exception):
    """A record that is quarantined; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class RawRecord:
    """One row as a reader yields it: a parsed record, or a rejection the reader already made."""

    line: int  # 1-based
    record: Any = None
    reason: str | None = None
    detail: str = ""


# ---------------------------------------------------------------------------------------- readers


class JsonlReader:
    """One JSON record per line, streamed; blank lines are skipped (and counted), not rows."""

    format = "jsonl"

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES):
        self.max_line_bytes = max_line_bytes
        self.blank_lines = 0

    def read(self, path: str) -> Iterator[RawRecord]:
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
            yield RawRecord(lineno, text, "invalid_json", f"{e.msg} at column {e.colno}")
            return
        except RecursionError:
            yield RawRecord(lineno, text[:PREFIX_BYTES], "invalid_json", "JSON nested too deeply to parse")
            return
        yield RawRecord(lineno, record)


class JsonReader:
    """A JSON file holding one top-level list of records (read whole: one file's worth)."""

    format = "json"

    def read(self, path: str) -> Iterator[RawRecord]:
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
            raise InputError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}{hint}") from None
        except RecursionError:
            raise InputError(f"{path}: JSON nested too deeply to parse") from None
        if not isinstance(records, list):
            found = f"an object with keys {_keys(records)}" if isinstance(records, dict) else type(records).__name__
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
                f"list one split folder as a source, e.g. {p / (splits[0] if splits else 'train')}"
            )
        found = sorted(c.name for c in p.iterdir())
        shown = ", ".join(found[:8]) + (", ..." if len(found) > 8 else "") if found else "nothing"
        raise InputError(
            f"{path}: is a folder but not a Hugging Face dataset saved with save_to_disk "
            f"(expected state.json and dataset_info.json in it; found {shown})"
        )

    def read(self, path: str) -> Iterator[RawRecord]:
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


def reader_for(path: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES):
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


# ---------------------------------------------------------------------------------- normalization


def normalize(record: Any) -> list[dict[str, str]]:
    """Return the normalized messages of one raw record, or raise Rejected with a REASONS reason."""
    if not isinstance(record, dict):
        raise Rejected("unknown_shape", f"record is a {type(record).__name__}, expected an object")
    present = [k for k in SHAPES if record.get(k) is not None]
    if len(present) != 1:
        which = (
            "both 'messages' and 'conversations'"
            if present
            else f"no 'messages' or 'conversations' key (keys: {_keys(record)})"
        )
        raise Rejected("unknown_shape", f"record has {which}")
    key = present[0]
    raw_messages = record[key]
    if not isinstance(raw_messages, list):
        raise Rejected("unknown_shape", f"'{key}' is a {type(raw_messages).__name__}, expected a list of messages")
    role_keys = (SHAPES[key][0], *(r for r, _ in SHAPES.values() if r != SHAPES[key][0]))
    content_keys = (SHAPES[key][1], *(c for _, c in SHAPES.values() if c != SHAPES[key][1]))

    messages = []
    for i, m in enumerate(raw_messages):
        where = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise Rejected("unknown_shape", f"{where} is a {type(m).__name__}, expected an object")
        role_raw = next((m[k] for k in role_keys if m.get(k) is not None), None)
        if role_raw is None:
            raise Rejected("missing_role", f"{where} has no {' or '.join(repr(k) for k in role_keys)}")
        name = role_raw.strip().lower() if isinstance(role_raw, str) else None
        raw_content = next((m[k] for k in content_keys if m.get(k) is not None), None)
        if name in TOOL_CALL_ROLES:  # ShareGPT: the value is the call itself
            messages.append({"role": "assistant", "content": "", "tool_calls": _tool_calls_json(raw_content, where)})
            continue
        role = ROLE_MAP.get(name)
        if role is None:
            known = ", ".join((*ROLE_MAP, *TOOL_CALL_ROLES))
            raise Rejected("unknown_role", f"{where} has role {role_raw!r} (known: {known})")
        calls = m.get("tool_calls") or ([m["function_call"]] if m.get("function_call") else None)
        if role == "assistant" and calls:
            calls = _tool_calls(calls, where)
            blank = raw_content is None or (isinstance(raw_content, str) and not raw_content.strip())
            content = "" if blank else _content(raw_content, where)
            messages.append({"role": role, "content": content, "tool_calls": calls})
            continue
        content = _content(raw_content, where)
        if role == "system" and i > 0:
            raise Rejected("misplaced_system", f"{where} is a system message; only the first message may be")
        message = {"role": role, "content": content}
        if role == "tool":  # which call it answers, where the record says so (some templates render it)
            message.update((k, m[k]) for k in ("tool_call_id", "name") if isinstance(m.get(k), str))
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise Rejected("no_assistant_turn", f"none of the {len(messages)} messages is from the assistant")
    return messages


def normalize_tools(record: dict) -> list[dict] | None:
    """The record's `tools` (function schemas for the chat template), a list of objects or None; OpenAI gives a
    list, ShareGPT (LLaMA-Factory) a JSON string of one. Raise Rejected("invalid_tool_call") otherwise."""
    tools = record.get("tools")
    if isinstance(tools, str):
        tools = _json_value(tools, "tools") if tools.strip() else None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Rejected("invalid_tool_call", f"'tools' is a {type(tools).__name__}, expected a list of objects")
    return tools


def _json_value(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise Rejected("invalid_tool_call", f"{where} is not valid JSON") from None


def _tool_calls_json(value: Any, where: str) -> list[dict[str, Any]]:
    """A ShareGPT function_call turn's value: one call or a list of calls, as JSON text or already parsed."""
    calls = _json_value(value, where) if isinstance(value, str) else value
    return _tool_calls(calls if isinstance(calls, list) else [calls], where)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Tool calls in transformers' shape: {"type": "function", "function": {"name", "arguments"}} (+ "id"),
    arguments parsed to an object when they are a JSON object's text (what chat templates expect)."""
    if not isinstance(calls, list):
        raise Rejected("invalid_tool_call", f"{where} tool_calls is a {type(calls).__name__}, expected a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise Rejected("invalid_tool_call", f"{where} tool call {j} has no function name")
        args = fn.get("arguments", fn.get("parameters"))
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError, RecursionError):
                parsed = json.loads(args)
                args = parsed if isinstance(parsed, dict) else args
        elif args is None:
            args = {}
        elif not isinstance(args, dict):
            raise Rejected("invalid_tool_call", f"{where} tool call {j} has arguments of type {type(args).__name__}")
        entry: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _content(content: Any, where: str) -> str:
    """The message text, verbatim; a list of {"type": "text", "text": ...} parts is joined with ""."""
    if isinstance(content, list):
        if not content:
            raise Rejected("empty_content", f"{where} has an empty list of content parts")
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise Rejected("non_text_content", f"{where} content part {j} is of type {kind!r}, not 'text'")
            if not isinstance(part.get("text"), str):
                raise Rejected(
                    "non_string_content",
                    f"{where} content part {j} has 'text' of type {type(part.get('text')).__name__}",
                )
            texts.append(part["text"])
        content = "".join(texts)  # HF chat templates concatenate text parts with no separator
    if content is None:
        raise Rejected("empty_content", f"{where} has no content")
    if not isinstance(content, str):
        raise Rejected("non_string_content", f"{where} content is a {type(content).__name__}, expected a string")
    if not content.strip():
        raise Rejected("empty_content", f"{where} content is empty or whitespace only")
    try:  # JSON may escape a lone surrogate ("\\ud800"): valid JSON, but no UTF-8 can hold it
        content.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Rejected("invalid_utf8", f"{where} content has a lone surrogate at character {e.start}") from None
    return content


def conversation_id(messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
    """sha256 (hex) of the canonical JSON of normalized messages (and tools, when the record has them): stable
    across runs and machines."""
    return hashlib.sha256(_canonical(messages, tools)).hexdigest()


def _canonical(messages: list[dict[str, Any]], tools: list[dict] | None = None) -> bytes:
    value = {"messages": messages, "tools": tools} if tools else messages  # ids without tools are unchanged
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# ------------------------------------------------------------------------------------------ stage


@dataclass(slots=True)
class FileCounts:
    file: str
    format: str
    rows_in: int = 0
    kept: int = 0
    duplicates: int = 0
    blank_lines: int = 0  # JSONL only; not rows
    quarantined: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "format": self.format,
            "rows_in": self.rows_in,
            "kept": self.kept,
            "duplicates": self.duplicates,
            "quarantined": dict(self.quarantined),
            "quarantined_total": sum(self.quarantined.values()),
            "blank_lines": self.blank_lines,
        }


def prepare(
    sources: list[str],
    out_conversations: str | os.PathLike,
    out_quarantine: str | os.PathLike,
    out_counts: str | os.PathLike,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> dict[str, Any]:
    """Read every source, write conversations / quarantine JSONL and counts JSON; return the counts.

    Args:
        sources: files, globs or save_to_disk folders, read in this order (globs sorted).
        out_conversations: JSONL of `Conversation.to_json()`, `source` = "path:line".
        out_quarantine: JSONL of `Quarantined.to_json()`.
        out_counts: JSON, layout in `_counts_json`.
        max_line_bytes: a longer JSONL line is quarantined as "line_too_long" without being parsed.
    """
    sources = [os.fspath(s) for s in sources]
    files = expand_sources(sources)
    readers = [reader_for(path, max_line_bytes) for path in files]  # fail on a bad source before reading
    seen: set[bytes] = set()  # sha256 digests of kept conversations (32 bytes each)
    duplicate_rows: list[dict[str, Any]] = []
    per_file: list[FileCounts] = []
    written = {"conversations": 0, "quarantine": 0}
    with (
        atomic_open(out_conversations, "w", encoding="utf-8") as conv_f,
        atomic_open(out_quarantine, "w", encoding="utf-8") as quar_f,
    ):
        for path, reader in zip(files, readers, strict=True):
            fc = FileCounts(path, reader.format)
            per_file.append(fc)
            for raw in reader.read(path):
                fc.rows_in += 1
                faults.kill_point("prepare.mid_stream", file=os.path.basename(path), line=raw.line)
                try:
                    if raw.reason is not None:
                        raise Rejected(raw.reason, raw.detail)
                    messages = normalize(raw.record)
                    tools = normalize_tools(raw.record)
                except Rejected as r:
                    fc.quarantined[r.reason] += 1
                    quar_f.write(_quarantine_line(Quarantined(path, raw.line, r.reason, r.detail, raw.record)))
                    written["quarantine"] += 1
                    continue
                digest = hashlib.sha256(_canonical(messages, tools)).digest()
                if digest in seen:
                    fc.duplicates += 1
                    if len(duplicate_rows) < MAX_LISTED_DUPLICATES:
                        duplicate_rows.append({"file": path, "line": raw.line, "id": digest.hex()})
                    continue
                seen.add(digest)
                fc.kept += 1
                conv = Conversation(digest.hex(), messages, f"{path}:{raw.line}", tools)
                conv_f.write(json.dumps(conv.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n")
                written["conversations"] += 1
            fc.blank_lines = getattr(reader, "blank_lines", 0)
        counts = _counts_json(sources, max_line_bytes, per_file, duplicate_rows)
        check_invariant(counts, written)
        faults.kill_point("prepare.before_rename")
    write_json(out_counts, counts)
    return counts


def _counts_json(sources, max_line_bytes, per_file: list[FileCounts], duplicate_rows) -> dict[str, Any]:
    """counts.json: {sources, max_line_bytes, files: [per file], totals, duplicate_rows[, _truncated]}."""
    files = [fc.to_json() for fc in per_file]
    totals: dict[str, Any] = {
        k: sum(f[k] for f in files) for k in ("rows_in", "kept", "duplicates", "quarantined_total", "blank_lines")
    }
    totals["quarantined"] = {r: sum(f["quarantined"][r] for f in files) for r in REASONS}
    totals["files"] = len(files)
    return {
        "sources": list(sources),
        "max_line_bytes": max_line_bytes,
        "files": files,
        "totals": totals,
        "duplicate_rows": duplicate_rows,  # first MAX_LISTED_DUPLICATES; `id` finds the kept first copy
        "duplicate_rows_truncated": totals["duplicates"] > len(duplicate_rows),
    }


def check_invariant(counts: dict[str, Any], written: dict[str, int] | None = None) -> None:
    """Raise unless rows_in == kept + duplicates + quarantined for every file and in total."""
    for c in [*counts["files"], counts["totals"]]:
        name = c.get("file", "totals")
        q = sum(c["quarantined"].values())
        if q != c["quarantined_total"] or c["rows_in"] != c["kept"] + c["duplicates"] + q:
            raise RuntimeError(
                f"prepare: row accounting broken for {name}: rows_in={c['rows_in']} != kept={c['kept']} "
                f"+ duplicates={c['duplicates']} + quarantined={q} (a bug in eagle3prep.prepare; please report it)"
            )
    t = counts["totals"]
    if written is not None and (written["conversations"], written["quarantine"]) != (
        t["kept"],
        t["quarantined_total"],
    ):
        raise RuntimeError(f"prepare: lines written {written} do not match counts {t} (a bug in eagle3prep.prepare)")


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


MAX_NAMED_FILES = 5  # require_conversations names at most this many source files


def require_conversations(counts_path: str | os.PathLike, quarantine_path: str | os.PathLike) -> None:
    """Raise NoConversationsError unless the prepare stage kept at least one conversation.

    Checked by the tokenize job, not by prepare itself: a failed job loses its outputs, and the user
    needs prepare's quarantine file to see why every record was rejected. An empty file among others
    is fine (counted, "(empty)" in the log); only a dataset with nothing in it stops the run here,
    before any engine starts on empty shards.
    """
    with open(counts_path, encoding="utf-8") as f:
        counts = json.load(f)
    t = counts["totals"]
    if t["kept"]:
        return

    def size(f: dict[str, Any]) -> str:
        if f["rows_in"]:
            return _plural(f["rows_in"], "record")
        return f"only {_plural(f['blank_lines'], 'blank line')}" if f["blank_lines"] else "empty"

    files = counts["files"]
    named = ", ".join(f"{f['file']} ({size(f)})" for f in files[:MAX_NAMED_FILES])
    if len(files) > MAX_NAMED_FILES:
        named += f" and {len(files) - MAX_NAMED_FILES} more files"
    if not t["rows_in"]:
        raise NoConversationsError(
            f"no conversations to tokenize: data.sources hold no records: {named}; "
            "list files that contain conversations in data.sources"
        )
    reasons = ", ".join(f"{r} {t['quarantined'][r]}" for r in REASONS if t["quarantined"].get(r))  # check order
    raise NoConversationsError(
        f"no conversations to tokenize: prepare quarantined all {_plural(t['rows_in'], 'record')} ({reasons}) "
        f"of {files[0]['file'] if len(files) == 1 else named}; each record and its reason is in {quarantine_path}"
    )


# ---------------------------------------------------------------------------------------- helpers


def _open_binary(path: str):
    try:
        return open(path, "rb")
    except OSError as e:
        raise InputError(f"{path}: cannot open ({e.strerror})") from None


def _quarantine_line(q: Quarantined) -> str:
    """One JSON line; a raw record that is not JSON (bytes, NaN, dates from parquet) is kept as its repr."""
    try:
        line = json.dumps(q.to_json(), ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"
        line.encode("utf-8")  # a lone surrogate from a JSON escape cannot be written (UnicodeEncodeError)
        return line
    except (TypeError, ValueError):
        q.record = repr(q.record)
        return json.dumps(q.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _keys(d: dict) -> str:
    keys = [str(k) for k in d]
    return "[" + ", ".join(keys[:10]) + (", ..." if len(keys) > 10 else "") + "]"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
