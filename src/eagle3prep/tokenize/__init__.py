"""The tokenize stage (DESIGN.md §3): normalized conversations -> contiguous shards of tokenized rows.

The loss mask is 1 exactly on assistant tokens, from the chat template's `{% generation %}` markers or,
without them, from the render boundary (module `template` says how). Rows that keep no assistant token
are quarantined with a reason, never dropped in silence. Row ids are assigned in input order before
sharding, so shard k is a contiguous row range.

Tool calling (assistant `tool_calls`, `tool` replies, the record's `tools`) is rendered by the template
like any turn: the mask covers the assistant's text and tool calls, not the tool results. A template
that fails on tool turns, or renders them without a call's name or arguments, a reply or a tool schema,
quarantines the conversation as `tool_turns_unsupported_by_template`: its hidden states would not be what is
served. What the template rendered is told by rendering the conversation once with each of these parts
swapped for a sentinel word (template.tool_probe), only for conversations with tool turns or schemas.

Images: a conversation with image parts is rendered the same way, then each image's placeholder
is expanded to the vision tokens the target's image processor gives it (module `vision`); the mask is 0 on
them, the row records its images and `image_grid_thw`, and a cut inside an image quarantines the row
(`image_cut_by_max_seq_len`). A target that cannot take images quarantines such rows as
`images_unsupported_by_target`; an image gone or changed since prepare as `image_missing` / `image_changed`.
On a vision-language target, a row whose text writes a vision placeholder token itself (`<|image_pad|>`, no
image to fill it) is quarantined as `media_token_in_text`: the engine would stop the extract job on it.

Modules, in the order a conversation meets them:
    files     the model folder's tokenizer files, checked before transformers reads them
    template  the tokenizer and chat template; ChatEncoder: conversation -> (input_ids, loss_mask)
    vision    images: loaded, checked against prepare's sha256, processed, placeholders expanded
    rows      a chunk of lines -> truncated, serialized rows or quarantine records, token counts
    workers   chunks encoded in this process or in worker processes, in input order
    stage     the `tokenize_conversations` driver: spill, shards, quarantine, token_freq, stats
"""

from eagle3prep.tokenize.rows import EncodedChunk, encode_lines, mask_runs, parse_conversation, row_json_tail
from eagle3prep.tokenize.stage import (
    BATCH_SIZE,
    TokenizeJobSettings,
    TokenizePaths,
    copy_lines,
    no_rows_error,
    run_tokenize_job,
    seq_len_summary,
    shard_ranges,
    tokenize_conversations,
)
from eagle3prep.tokenize.template import (
    GENERATION_RE,
    PROBE,
    TOOL_REASON,
    ChatEncoder,
    ModelNotFoundError,
    Rejected,
    TokenizeError,
    choose_mask_source,
    dropped_tool_part,
    get_chat_template,
    has_tool_turns,
    load_tokenizer,
    rust_backend,
    tool_probe,
)
from eagle3prep.tokenize.workers import batched, encode_chunks

__all__ = [
    "BATCH_SIZE",
    "GENERATION_RE",
    "PROBE",
    "TOOL_REASON",
    "ChatEncoder",
    "EncodedChunk",
    "ModelNotFoundError",
    "Rejected",
    "TokenizeError",
    "TokenizeJobSettings",
    "TokenizePaths",
    "batched",
    "choose_mask_source",
    "copy_lines",
    "dropped_tool_part",
    "encode_chunks",
    "encode_lines",
    "get_chat_template",
    "has_tool_turns",
    "load_tokenizer",
    "mask_runs",
    "no_rows_error",
    "parse_conversation",
    "run_tokenize_job",
    "row_json_tail",
    "rust_backend",
    "seq_len_summary",
    "shard_ranges",
    "tokenize_conversations",
    "tool_probe",
]
