"""Row accounting of the regenerate stage, in the shape of prepare's counts.json (prepare.counts) and checked by
the same check_invariant: every conversation in is kept (regenerated) or quarantined with one of REASONS, per
shard and in total, and the lines written match. Replies are counted too, by how they finished."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3prep.prepare.counts import check_invariant

# Quarantine reasons of the regenerate stage, in the order a conversation meets them.
REASONS = (
    "no_user_turn",  # no user message: nothing to reply to
    "tool_turns",  # turns: all on a conversation with tool calls or results (they answer the dataset's calls)
    "prompt_too_long",  # a prompt (history + earlier replies) leaves no room for a reply in max_model_len
    "engine_error",  # the engine refused a request, or ended it with an error or abort
    "cut_by_max_tokens",  # a reply reached sampling.max_tokens (finish_reason "length"), on_length: quarantine
    "empty_reply",  # a reply with no text, on_empty: quarantine
)
# Reasons of conversations with images, as tokenize names them; counts.json lists them only for a shard that met
# an image, so text-only shards keep their bytes.
IMAGE_REASONS = (
    "images_unsupported_by_target",  # a text-only target, or a family whose image expansion is not implemented
    "image_missing",  # an image file gone since prepare
    "image_changed",  # an image file whose bytes are not the ones prepare hashed
    "image_unreadable",  # a data: URI that is not base64 (prepare.images)
    "image_unsupported_format",  # a data: URI of no image type (prepare.images)
    "image_expansion_differs",  # vLLM's processor expanded the prompt's images otherwise than tokenize does
    "reply_has_image_token",  # a reply wrote the image placeholder itself (more placeholders than images)
)

# Per-reply counts (a conversation has one reply per step).
REPLY_KEYS = (
    "requests",  # requests the engine accepted
    "stop",  # ended by an end-of-turn token
    "length",  # cut by max_tokens or max_model_len (kept or quarantined per on_length)
    "error",  # ended by the engine with an error or abort
    "rejected",  # refused by the engine when added
    "empty",  # no text (kept or quarantined per on_empty)
    "with_thinking",  # held text between the thinking markers
    "unterminated_thinking",  # opened the thinking and never closed it
    "retokenized_differently",  # prompt + decoded reply text encodes to other ids than prompt + generated ids
    "prompt_tokens",
    "output_tokens",  # generated, the stop token included
)


@dataclass(slots=True)
class ShardTally:
    """What became of one shard's conversations and replies."""

    file: str
    rows_in: int = 0
    kept: int = 0
    quarantined: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    replies: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REPLY_KEYS, 0))

    def met_images(self) -> None:
        """A conversation with images: the image reasons join the counts."""
        for r in IMAGE_REASONS:
            self.quarantined.setdefault(r, 0)

    def file_json(self) -> dict[str, Any]:
        """Its entry in counts.json's "files", in prepare's FileCounts shape (no duplicates at this stage)."""
        return {
            "file": self.file,
            "format": "jsonl",
            "rows_in": self.rows_in,
            "kept": self.kept,
            "duplicates": 0,
            "quarantined": dict(self.quarantined),
            "quarantined_total": sum(self.quarantined.values()),
            "blank_lines": 0,
            "replies": dict(self.replies),
        }


def totals(files: list[dict[str, Any]]) -> dict[str, Any]:
    """The files' counts added up, as prepare's counts.json "totals"."""
    out: dict[str, Any] = {
        k: sum(f[k] for f in files) for k in ("rows_in", "kept", "duplicates", "quarantined_total", "blank_lines")
    }
    reasons = dict.fromkeys([*REASONS, *(r for f in files for r in f["quarantined"])])  # then any image reasons
    out["quarantined"] = {r: sum(f["quarantined"].get(r, 0) for f in files) for r in reasons}
    out["replies"] = {k: sum(f["replies"][k] for f in files) for k in REPLY_KEYS}
    out["files"] = len(files)
    return out


def shard_counts(tally: ShardTally, written: dict[str, int]) -> dict[str, Any]:
    """One shard's counts.json, checked: rows in = kept + quarantined, and as many lines written."""
    files = [tally.file_json()]
    counts = {"stage": "regenerate", "files": files, "totals": totals(files)}
    check_invariant(counts, written, stage="regenerate")
    return counts


def merged_counts(shards: list[dict[str, Any]], prepared: dict[str, Any], written: dict[str, int]) -> dict[str, Any]:
    """results/regenerated/counts.json: every shard's file entry, the totals, and prepare's sources and totals
    (the report's row funnel starts there). Checked: the shards' rows in are prepare's kept conversations."""
    files = [f for s in shards for f in s["files"]]
    counts = {
        "stage": "regenerate",
        "files": files,
        "totals": totals(files),
        "prepared": {"sources": prepared.get("sources"), "totals": prepared["totals"]},
    }
    check_invariant(counts, written, stage="regenerate")
    if counts["totals"]["rows_in"] != prepared["totals"]["kept"]:
        raise RuntimeError(
            f"regenerate: the shards took {counts['totals']['rows_in']} conversations, prepare kept "
            f"{prepared['totals']['kept']} (a bug in eagle3prep.regenerate; please report it)"
        )
    return counts


def summarize(counts: dict[str, Any]) -> str:
    """One line for the log: conversations in, kept, quarantined by reason, and how the replies ended."""
    t = counts["totals"]
    reasons = ", ".join(f"{r} {n}" for r, n in t["quarantined"].items() if n)
    r = t["replies"]
    return (
        f"{t['rows_in']} conversations in, {t['kept']} regenerated, {t['quarantined_total']} quarantined"
        + (f" ({reasons})" if reasons else "")
        + f"; {r['requests']} replies: {r['stop']} stopped, {r['length']} cut by max_tokens, {r['error']} errors, "
        f"{r['empty']} empty, {r['with_thinking']} with thinking ({r['unterminated_thinking']} unterminated), "
        f"{r['retokenized_differently']} retokenized differently; {r['output_tokens']} tokens generated"
    )
