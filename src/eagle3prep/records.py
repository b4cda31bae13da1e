"""The records that flow between stages, each defined once (DESIGN.md §3, §4)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def _shallow(obj: Any) -> dict[str, Any]:
    """Like dataclasses.asdict without deep-copying token lists (60 % of tokenize time on 20k rows)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


@dataclass(slots=True)
class Conversation:
    """A normalized conversation: roles are exactly system | user | assistant | tool."""

    id: str  # content hash of `messages` (and `tools`): stable across runs and machines
    messages: list[dict[str, Any]]  # [{"role": ..., "content": ...}], assistant turns may carry "tool_calls"
    source: str  # "path:line" of the raw record it came from
    tools: list[dict[str, Any]] | None = None  # function schemas the chat template renders; omitted when None
    # Set by the regenerate stage: the prepared conversation's id ("from"), its seed, each reply's finish
    # reason and token count. Omitted when None, so conversations that were not regenerated keep their bytes.
    regenerated: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = _shallow(self)
        for key in ("tools", "regenerated"):
            if out[key] is None:  # conversations without tools keep their bytes
                del out[key]
        return out


@dataclass(slots=True)
class TokenizedRow:
    """One line of results/tokenized/shard_{k}.jsonl (DESIGN.md §3)."""

    row: int  # global, stable index assigned before sharding
    id: str  # the conversation's content hash
    input_ids: list[int]
    loss_mask: list[int]  # 1 exactly on assistant tokens (0 on every image token)
    seq_len: int
    # A row with images: each image's {"image": path, or None for a data: URI kept in the
    # conversation, "sha256"} and the processor's (t, h, w) patch grid. Omitted when None: text rows keep their bytes.
    images: list[dict[str, Any]] | None = None
    image_grid_thw: list[list[int]] | None = None

    def to_json(self) -> dict[str, Any]:
        out = _shallow(self)
        for key in ("images", "image_grid_thw"):
            if out[key] is None:
                del out[key]
        return out


@dataclass(slots=True)
class IndexEntry:
    """Where one row's tokens sit in a shard's layer files (DESIGN.md §4 index.json)."""

    row: int
    id: str
    offset: int  # first token of the row in the [sum_T, H] layer tensors
    length: int  # number of tokens (= seq_len)

    def to_json(self) -> dict[str, Any]:
        return _shallow(self)


@dataclass(slots=True)
class Quarantined:
    """A record kept out of the dataset, with the reason why (never a silent drop)."""

    file: str
    line: int  # 1-based line (JSONL), row number (parquet/HF dataset) or 0 for a whole file
    reason: str  # short machine-readable reason, e.g. "no_assistant_tokens"
    detail: str  # one human-readable sentence
    record: Any = field(default=None)  # the raw record (or its repr when it is not JSON)

    def to_json(self) -> dict[str, Any]:
        return _shallow(self)
