"""Sample rows for the report: a few tokenized rows from different shards, cut into runs of text that
are trained on (loss_mask 1) or not, with the chat template's special tokens as runs of their own.
What a practitioner checks before spending GPU-days: does the mask cover the replies, and only them?"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..shard.tokenized import rows as tokenized_rows

SAMPLE_ROWS = 3  # rows per run, from shards spread over the run
SAMPLE_MAX_TOKENS = 400  # tokens shown per row; a longer row shows a window from before its first trained token
SCAN_LINES = 200  # lines read per shard looking for a row with both masked and trained tokens


@dataclass
class Sample:
    shard: int
    row: int
    id: str
    seq_len: int
    trained: int  # tokens with loss_mask 1 in the whole row
    start: int  # first token shown
    at_cap: bool  # as long as max_seq_len: tokenize may have cut its end
    segments: list[tuple[str, bool, bool]] = field(default_factory=list)  # (text, trained, special)

    @property
    def end(self) -> int:
        return self.start + min(self.seq_len - self.start, SAMPLE_MAX_TOKENS)


def _spread(n_shards: int, k: int) -> list[int]:
    """k shard numbers spread over 0..n-1 (first, last and between); repeats when there are fewer shards."""
    if n_shards <= 0:
        return []
    if k == 1:
        return [0]
    return [round(i * (n_shards - 1) / (k - 1)) for i in range(k)]


def pick_rows(tokenized: list[str], k: int = SAMPLE_ROWS) -> list[tuple[int, dict[str, Any]]]:
    """(shard, row) of up to k rows with both trained and untrained tokens, from shards spread over the run
    (a shard picked twice gives its next such row); short rows first, so a row shows whole."""
    out, used = [], set()
    for shard in _spread(len(tokenized), k):
        candidates = []
        if not Path(tokenized[shard]).is_file():
            continue
        for r in tokenized_rows(tokenized[shard], limit=SCAN_LINES):
            if 0 < sum(r["loss_mask"]) < r["seq_len"] and (shard, r["row"]) not in used:
                candidates.append(r)
        if candidates:
            # the first row short enough to show whole, else the shortest one scanned
            r = next((c for c in candidates if c["seq_len"] <= SAMPLE_MAX_TOKENS), None)
            r = r or min(candidates, key=lambda c: c["seq_len"])
            used.add((shard, r["row"]))
            out.append((shard, r))
    return out


def template_token_ids(tokenizer) -> set[int]:
    """The special tokens and every added token (chat templates' role and turn markers are added tokens)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return ids


def segments(ids: list[int], mask: list[int], tokenizer, special: set[int]) -> list[tuple[str, bool, bool]]:
    """Runs of (text, trained, special): consecutive ordinary tokens with the same mask decode together
    (whole characters, not byte pieces); each special token is a run of its own. Without a tokenizer
    (None) every token shows as its id."""
    out: list[tuple[str, bool, bool]] = []
    run: list[int] = []

    def flush(trained: bool) -> None:
        if run:
            text = _decode(tokenizer, run) if tokenizer is not None else " ".join(f"⟨{i}⟩" for i in run)
            out.append((text, trained, False))
            run.clear()

    prev = None
    for i, m in zip(ids, mask, strict=True):
        trained = bool(m)
        if i in special:
            flush(bool(prev))
            out.append((_decode(tokenizer, [i]), trained, True))
            prev = None
            continue
        if prev is not None and trained != prev:
            flush(prev)
        run.append(i)
        prev = trained
    flush(bool(prev))
    return out


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def samples(tokenized: list[str], tokenizer, k: int = SAMPLE_ROWS, max_seq_len: int | None = None) -> list[Sample]:
    """The report's sample rows, each cut to SAMPLE_MAX_TOKENS around its first trained token;
    `max_seq_len` marks a row that tokenize cut there."""
    special = template_token_ids(tokenizer) if tokenizer is not None else set()
    out = []
    for shard, r in pick_rows(tokenized, k):
        ids, mask = r["input_ids"], r["loss_mask"]
        first = mask.index(1)
        start = (
            0
            if len(ids) <= SAMPLE_MAX_TOKENS
            else max(0, min(first - SAMPLE_MAX_TOKENS // 4, len(ids) - SAMPLE_MAX_TOKENS))
        )
        s = Sample(shard, r["row"], r["id"], r["seq_len"], sum(mask), start, r["seq_len"] == max_seq_len)
        s.segments = segments(ids[s.start : s.end], mask[s.start : s.end], tokenizer, special)
        out.append(s)
    return out


def load_tokenizer_or_reason(model_path: str | None, trust_remote_code: bool) -> tuple[Any, str]:
    """(tokenizer, "") or (None, why): the samples then show token ids, and the page says why."""
    if not model_path:
        return None, "no model folder given"
    from ..errors import UserError
    from ..tokenize.template import load_tokenizer

    try:
        return load_tokenizer(model_path, trust_remote_code), ""
    except (UserError, OSError, ValueError) as e:
        return None, f"tokenizer of {model_path} not loadable ({str(e).splitlines()[0]})"
