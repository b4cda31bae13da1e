"""The gate's own rows: a few prompts of the first shard and the target's greedy replies to them.

A prompt is a tokenized row's ids before its first loss-masked token: the rendered conversation up to
and including the first assistant turn's generation prompt, as tokenize made it with the run's chat
template and kwargs (the prefix the regenerate stage renders for that turn; its tests check it). The
reply is what vLLM generated for it, ids as the engine returned them (the stop token included), so the
draft trains on the very sequences the served target writes: prompt + reply, the reply loss-masked.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..infra.atomic import atomic_open, write_json
from ..shard.tokenized import rows as tokenized_rows


@dataclass(frozen=True, slots=True)
class Prompt:
    row: int  # the tokenized row it was cut from
    ids: list[int]


def pick_prompts(tokenized_shard: str | Path, n: int, max_len: int) -> list[Prompt]:
    """The first `n` rows' prompts that are non-empty and at most `max_len` tokens (a reply must fit
    after it in the engine's max_model_len)."""
    out: list[Prompt] = []
    for r in tokenized_rows(tokenized_shard):
        first = r["loss_mask"].index(1) if 1 in r["loss_mask"] else 0
        if 0 < first <= max_len:
            out.append(Prompt(r["row"], r["input_ids"][:first]))
            if len(out) == n:
                break
    return out


def training_rows(prompts: list[Prompt], replies: list[list[int]], copies: int = 1) -> list[dict]:
    """Tokenized rows (DESIGN.md §3) of prompt + reply, `copies` times over (so that one epoch holds
    several optimizer steps: each epoch also validates and rebuilds its loader, a second of a CPU step's
    third), then one more: a copy of the shortest as the validation split speculators' trainer requires
    (its train_data_ratio is < 1; see train.ratio_for)."""
    one = []
    for p, reply in zip(prompts, replies, strict=True):
        ids = p.ids + list(reply)
        one.append({"input_ids": ids, "loss_mask": [0] * len(p.ids) + [1] * len(reply), "seq_len": len(ids)})
    rows = one * copies
    rows.append(dict(min(one, key=lambda r: r["seq_len"])))
    return [
        {"row": i, "id": hashlib.sha256(json.dumps(r["input_ids"]).encode()).hexdigest()[:16], **r}
        for i, r in enumerate(rows)
    ]


def write_rows(rows: list[dict], tokenized: Path, token_freq: Path) -> None:
    """The rows as a tokenized shard, and the loss-masked token counts the export's token_freq.pt (the
    draft vocabulary) is made from, as tokenize writes both."""
    tokenized.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(tokenized, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    counts = Counter(t for r in rows for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m)
    write_json(token_freq, {str(t): c for t, c in sorted(counts.items())})
