"""The `prepare` stage: raw chat files -> normalized conversations, quarantine, counts.

Reads JSONL, JSON (a top-level list), parquet files and Hugging Face `save_to_disk` folders, in the
order given (globs expanded, sorted). Each record is normalized to `Conversation.messages`
(`[{"role": system|user|assistant|tool, "content": str}]`) from the ShareGPT shape
(`conversations: [{from, value}]`) or the OpenAI shape (`messages: [{role, content}]`), or is
quarantined with one of `REASONS`. Tool calling is kept in the shape transformers' chat templates
render: an assistant message's `tool_calls: [{"type": "function", "function": {name, arguments}}]`
(from OpenAI `tool_calls`/`function_call` or a ShareGPT `function_call` turn), `role: tool` replies
(OpenAI `tool`/`function`, ShareGPT `observation`), and the record's `tools` schemas. Exact duplicates
(same content hash) are dropped after the first occurrence and counted. Every input row ends up in
exactly one of kept / duplicates / quarantined, and `prepare` raises if that does not add up.

Line numbers are 1-based everywhere (JSONL line, JSON list element, parquet/dataset row + 1);
`Quarantined.line == 0` means a whole file.

Modules, in the order a row meets them:
    readers    input formats -> RawRecord rows; the source list (globs, checks)
    normalize  a record -> normalized messages and tools, or Rejected; conversation ids
    counts     per-file counts, counts.json, the row-accounting check, the log summary
    stage      the `prepare` driver that ties them together and writes the outputs; run_prepare_job, the job
    images     image references (data: URIs, paths, file:// URLs) read with Pillow -> image parts, or Rejected
    errors     InputError, NoConversationsError, Rejected and the quarantine REASONS (and IMAGE_REASONS)
"""

from eagle3prep.prepare.counts import (
    MAX_LISTED_DUPLICATES,
    MAX_NAMED_FILES,
    FileCounts,
    check_invariant,
    counts_json,
    require_conversations,
    summarize,
)
from eagle3prep.prepare.errors import IMAGE_REASONS, REASONS, InputError, NoConversationsError, Rejected
from eagle3prep.prepare.normalize import (
    ROLE_MAP,
    SHAPES,
    TOOL_CALL_ROLES,
    conversation_digest,
    conversation_id,
    normalize,
    normalize_tools,
)
from eagle3prep.prepare.readers import (
    BATCH_ROWS,
    PREFIX_BYTES,
    READERS,
    HFDiskReader,
    JsonlReader,
    JsonReader,
    ParquetReader,
    RawRecord,
    expand_sources,
    reader_for,
)
from eagle3prep.prepare.stage import PrepareJobSettings, PreparePaths, prepare, quarantine_line, run_prepare_job

__all__ = [
    "BATCH_ROWS",
    "IMAGE_REASONS",
    "MAX_LISTED_DUPLICATES",
    "MAX_NAMED_FILES",
    "PREFIX_BYTES",
    "READERS",
    "REASONS",
    "ROLE_MAP",
    "SHAPES",
    "TOOL_CALL_ROLES",
    "FileCounts",
    "HFDiskReader",
    "InputError",
    "JsonReader",
    "JsonlReader",
    "NoConversationsError",
    "ParquetReader",
    "PrepareJobSettings",
    "PreparePaths",
    "RawRecord",
    "Rejected",
    "check_invariant",
    "conversation_digest",
    "conversation_id",
    "counts_json",
    "expand_sources",
    "normalize",
    "normalize_tools",
    "prepare",
    "quarantine_line",
    "reader_for",
    "require_conversations",
    "run_prepare_job",
    "summarize",
]
