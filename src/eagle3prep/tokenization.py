"""The tokenize stage (DESIGN.md §3): normalized conversations -> contiguous shards of tokenized rows.

The loss mask is 1 exactly on assistant tokens. It comes from the chat template's
`{% generation %}` markers when the template has them, else (tokenize.template_fallback) from the
render boundary: for assistant turn i, the text between render(messages[:i], add_generation_prompt=True)
and render(messages[:i+1]), less trailing whitespace (template glue such as the "\\n" after
<|im_end|>). On the demo tokenizer both give the same mask.

Rows that keep no assistant token are quarantined with a reason, never dropped in silence. Row ids
are assigned in input order before sharding, so shard k is a contiguous row range.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3prep import faults
from eagle3prep.atomic import TMP_PREFIX, atomic_open, write_json, write_jsonl
from eagle3prep.config import check_max_seq_len
from eagle3prep.errors import UserError
from eagle3prep.provenance import tokenizer_identity
from eagle3prep.records import Quarantined, TokenizedRow

# The test transformers itself uses to decide whether a template tracks generation spans.
GENERATION_RE = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
PROBE = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello, how can I help?"}]
BATCH_SIZE = 256  # conversations per render + batch-encode call


@dataclass(slots=True)
class Rejected:
    """A conversation the encoder could not turn into a row."""

    reason: str
    detail: str


class TokenizeError(UserError, ValueError):
    """The model folder's tokenizer or chat template cannot make rows; the message names the folder and the fix."""


class ModelNotFoundError(UserError, FileNotFoundError):
    """model.path is not a folder."""


def load_tokenizer(model_path: str | os.PathLike, trust_remote_code: bool = False):
    """The target model's tokenizer, from its local folder only (no hub access)."""
    if not Path(model_path).is_dir():
        raise ModelNotFoundError(
            f"model folder {model_path} not found; set model.path to a Hugging Face model folder "
            "(or model.build_demo: true to build the demo model there)"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code, local_files_only=True)
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizeError(
            f"{model_path}: the tokenizer is a slow (Python) tokenizer, but the loss mask needs character offsets; "
            "add a tokenizer.json (a fast tokenizer) to the model folder"
        )
    return tokenizer


def get_chat_template(tokenizer, model_path: str | os.PathLike) -> str:
    try:
        return tokenizer.get_chat_template()
    except ValueError:
        raise TokenizeError(
            f"{model_path}: the tokenizer has no usable chat template (no chat_template.jinja, no default "
            "chat_template in tokenizer_config.json); copy the instruct model's chat_template.jinja into the folder"
        ) from None


class ChatEncoder:
    """Renders conversations with the target's chat template; returns (input_ids, loss_mask) per conversation.

    Args:
        tokenizer: a fast transformers tokenizer with a chat template.
        model_path: only for error messages.
        template_fallback: without `{% generation %}` markers, derive the mask from the render boundary.
    """

    def __init__(self, tokenizer, model_path: str | os.PathLike, template_fallback: bool = True):
        self.tokenizer = tokenizer
        self.template = get_chat_template(tokenizer, model_path)
        if GENERATION_RE.search(self.template):
            self.mask_source = "generation_markers"
        elif template_fallback:
            self.mask_source = "render_boundary"
        else:
            raise TokenizeError(
                f"{model_path}: the chat template has no {{% generation %}} markers and tokenize.template_fallback "
                "is false; set tokenize.template_fallback: true, or wrap the assistant content in "
                "{% generation %}...{% endgeneration %} in the model's chat template"
            )
        probe = self.encode([PROBE])[0]
        if isinstance(probe, Rejected) or not any(probe[1]):
            why = probe.detail if isinstance(probe, Rejected) else "no token of the assistant reply is masked"
            fix = (
                "fix the {% generation %} block"
                if self.mask_source == "generation_markers"
                else "add {% generation %}...{% endgeneration %} around the assistant content"
            )
            raise TokenizeError(
                f"{model_path}: cannot derive the loss mask from the chat template ({self.mask_source}) "
                f"on a user/assistant probe: {why}; {fix} in the model's chat template"
            )

    def encode(self, batch: list[list[dict[str, str]]]) -> list[tuple[list[int], list[int]] | Rejected]:
        """One result per conversation: (input_ids, loss_mask), not truncated, or Rejected."""
        import jinja2

        try:
            if self.mask_source == "generation_markers":
                return self._encode_markers(batch)
            return self._encode_boundary(batch)
        except jinja2.TemplateError as e:
            # One bad conversation (a template's raise_exception) must not sink its batch.
            if len(batch) == 1:
                return [Rejected("template_error", f"the chat template raised: {e}")]
            return [self.encode([messages])[0] for messages in batch]

    def _encode_markers(self, batch):
        out = self.tokenizer.apply_chat_template(
            batch, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return [(list(ids), list(mask)) for ids, mask in zip(out["input_ids"], out["assistant_masks"], strict=True)]

    def _render(self, conversations: list[list[dict[str, str]]], add_generation_prompt: bool) -> list[str]:
        if not conversations:
            return []
        # A batched call also renders an empty history (the prompt before an opening assistant turn).
        return self.tokenizer.apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode_boundary(self, batch):
        # Renders per batch: the full conversations, every assistant turn's history with the generation
        # prompt, and every history including that turn.
        turns = [
            (b, i) for b, messages in enumerate(batch) for i, m in enumerate(messages) if m["role"] == "assistant"
        ]
        full = self._render(batch, add_generation_prompt=False)
        prompts = self._render([batch[b][:i] for b, i in turns], add_generation_prompt=True)
        with_turn = self._render([batch[b][: i + 1] for b, i in turns], add_generation_prompt=False)
        spans: list[list[tuple[int, int]] | Rejected] = [[] for _ in batch]
        for (b, i), prompt, turn in zip(turns, prompts, with_turn, strict=True):
            if isinstance(spans[b], Rejected):
                continue
            if not turn.startswith(prompt):
                spans[b] = Rejected(
                    "template_not_prefix_stable",
                    f"messages[:{i}] rendered with the generation prompt is not a prefix of messages[:{i + 1}]",
                )
            elif not full[b].startswith(turn):
                spans[b] = Rejected(
                    "template_not_prefix_stable",
                    f"messages[:{i + 1}] rendered alone is not a prefix of the whole conversation rendered",
                )
            else:
                reply = turn[len(prompt) :].rstrip()
                spans[b].append((len(prompt), len(prompt) + len(reply)))
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        results = []
        for b, span in enumerate(spans):
            if isinstance(span, Rejected):
                results.append(span)
                continue
            ids, offsets = enc["input_ids"][b], enc["offset_mapping"][b]
            # A token is an assistant token when its characters overlap an assistant span.
            mask = [int(any(start < e and end > s for s, e in span)) for start, end in offsets]
            results.append((list(ids), mask))
        return results


_WORKER_ENCODER: ChatEncoder | None = None


def _init_worker(model_path, template_fallback: bool, trust_remote_code: bool) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = ChatEncoder(load_tokenizer(model_path, trust_remote_code), model_path, template_fallback)


def _encode_in_worker(messages: list[list[dict[str, str]]]) -> list:
    return _WORKER_ENCODER.encode(messages)


def encode_batches(batches: Iterator[list], encoder: ChatEncoder, workers: int, init_args: tuple) -> Iterator[tuple]:
    """(batch, encode results) in input order; with workers > 1 the batches are encoded in worker processes.

    At most 2 x workers batches are in flight, so memory stays bounded by the batch, not the dataset.
    Rendering the chat template (Jinja, Python) is the bottleneck that threads cannot share.
    """
    if workers <= 1:
        for batch in batches:
            yield batch, encoder.encode([conv["messages"] for _, conv in batch])
        return
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=init_args) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append((batch, pool.submit(_encode_in_worker, [conv["messages"] for _, conv in batch])))
            if len(pending) >= 2 * workers:
                done, fut = pending.popleft()
                yield done, fut.result()
        while pending:
            done, fut = pending.popleft()
            yield done, fut.result()


def read_conversations(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line, Conversation JSON) for each line of the prepare stage's output."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            try:
                conv = json.loads(line)
                ok = isinstance(conv["id"], str) and all(
                    isinstance(m["role"], str) and isinstance(m["content"], str) for m in conv["messages"]
                )
            except (json.JSONDecodeError, KeyError, TypeError):
                ok = False
            if not ok:
                raise TokenizeError(
                    f"{path}:{line_no}: not a normalized conversation ({{id, messages: [{{role, content}}], source}}); "
                    "re-run the prepare stage"
                )
            yield line_no, conv


def batched(items: Iterator, n: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def shard_ranges(n_rows: int, n_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) row ranges whose sizes differ by at most one (the first ones are larger)."""
    base, extra = divmod(n_rows, n_shards)
    ranges, start = [], 0
    for k in range(n_shards):
        end = start + base + (1 if k < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def seq_len_summary(seq_lens: array) -> dict[str, float] | None:
    if not seq_lens:
        return None
    s = sorted(seq_lens)

    def pct(p: float) -> int:  # nearest rank
        return s[max(0, math.ceil(p / 100 * len(s)) - 1)]

    return {"min": s[0], "mean": round(sum(s) / len(s), 2), "p50": pct(50), "p95": pct(95), "max": s[-1]}


def tokenize_conversations(
    conversations_path: str | os.PathLike,
    model_path: str | os.PathLike,
    out_shards: list[str | os.PathLike],
    stats_path: str | os.PathLike,
    token_freq_path: str | os.PathLike,
    quarantine_path: str | os.PathLike,
    max_seq_len: int,
    template_fallback: bool = True,
    trust_remote_code: bool = False,
    batch_size: int = BATCH_SIZE,
    workers: int = 1,
) -> dict[str, Any]:
    """Tokenize every conversation with the target's chat template into len(out_shards) contiguous shards.

    Args:
        conversations_path: the prepare stage's JSONL, one `Conversation.to_json()` a line.
        model_path: the target model folder (its tokenizer and chat template are used).
        out_shards: shard k's JSONL path (`TokenizedRow.to_json()` a line); every one is written, maybe empty.
        stats_path: JSON summary (row/token counts, truncation, quarantine reasons, per-shard sizes, hashes).
        token_freq_path: JSON {token_id: count} over loss-masked tokens (speculators' token_freq.pt semantics).
        quarantine_path: JSONL of `Quarantined` records (reasons: no_assistant_tokens,
            template_not_prefix_stable, template_error).
        max_seq_len: rows longer than this are truncated (and counted).

    Returns:
        The stats dict also written to `stats_path`.
    """
    if not out_shards:
        raise TokenizeError("out_shards is empty; tokenize.num_shards must be at least 1")
    tokenizer = load_tokenizer(model_path, trust_remote_code)
    check_max_seq_len(max_seq_len, model_path)
    encoder = ChatEncoder(tokenizer, model_path, template_fallback)
    if max_seq_len > tokenizer.model_max_length:
        print(
            f"tokenize: warning: max_seq_len {max_seq_len} is above the tokenizer's model_max_length "
            f"{tokenizer.model_max_length} ({model_path}); the model may not take rows that long",
            file=sys.stderr,
        )
    identity = tokenizer_identity(str(model_path))

    seq_lens = array("q")
    token_freq: Counter[int] = Counter()
    quarantined: list[Quarantined] = []
    n_in = n_tokens = n_assistant = n_truncated = 0

    # Rows go to a spill file first: how many rows each shard gets is known only at the end, and
    # host memory must not grow with the dataset.
    spill_dir = Path(out_shards[0]).parent
    spill_dir.mkdir(parents=True, exist_ok=True)
    # A fixed name: a killed run's spill is overwritten by the rerun, then removed, not left behind.
    spill = spill_dir / f"{TMP_PREFIX}tokenize-spill.jsonl"
    try:
        with open(spill, "w", encoding="utf-8") as spill_f:
            batches = batched(read_conversations(conversations_path), batch_size)
            for batch, results in encode_batches(
                batches, encoder, workers, (model_path, template_fallback, trust_remote_code)
            ):
                for (line_no, conv), result in zip(batch, results, strict=True):
                    n_in += 1
                    faults.kill_point("tokenize.mid_stream", rows_in=n_in)
                    if isinstance(result, Rejected):
                        quarantined.append(
                            Quarantined(str(conversations_path), line_no, result.reason, result.detail, conv)
                        )
                        continue
                    ids, mask = result
                    full_len = len(ids)
                    if full_len > max_seq_len:
                        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
                    if not any(mask):
                        where = (
                            f" within the first {max_seq_len} of {full_len} tokens" if full_len > max_seq_len else ""
                        )
                        quarantined.append(
                            Quarantined(
                                str(conversations_path), line_no, "no_assistant_tokens",
                                f"no assistant token{where} after applying the chat template", conv,
                            )
                        )  # fmt: skip
                        continue
                    n_truncated += full_len > max_seq_len
                    row = TokenizedRow(
                        row=len(seq_lens), id=conv["id"], input_ids=ids, loss_mask=mask, seq_len=len(ids)
                    )
                    spill_f.write(json.dumps(row.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n")
                    seq_lens.append(len(ids))
                    n_tokens += len(ids)
                    n_assistant += sum(mask)
                    token_freq.update(t for t, m in zip(ids, mask, strict=True) if m)

        shards = []
        with open(spill, encoding="utf-8") as spill_f:
            for k, (start, end) in enumerate(shard_ranges(len(seq_lens), len(out_shards))):
                # Lines are copied as written: the same format as atomic.write_jsonl.
                with atomic_open(out_shards[k], "w", encoding="utf-8") as f:
                    for _ in range(start, end):
                        f.write(spill_f.readline())
                shards.append(
                    {"shard": k, "path": str(out_shards[k]), "first_row": start, "rows": end - start,
                     "tokens": sum(seq_lens[start:end])}
                )  # fmt: skip
                faults.kill_point("tokenize.between_shards", shard=k)
    finally:
        with contextlib.suppress(FileNotFoundError):
            spill.unlink()

    assert n_in == len(seq_lens) + len(quarantined), "rows in != rows out + quarantined"
    write_jsonl(quarantine_path, (q.to_json() for q in quarantined))
    write_json(token_freq_path, {str(t): c for t, c in sorted(token_freq.items())})
    stats = {
        "conversations_path": str(conversations_path),
        "model_path": str(model_path),
        "conversations_in": n_in,
        "rows": len(seq_lens),
        "tokens": n_tokens,
        "assistant_tokens": n_assistant,
        "assistant_token_share": round(n_assistant / n_tokens, 6) if n_tokens else 0.0,
        "max_seq_len": max_seq_len,
        "truncated_rows": n_truncated,
        "quarantined": dict(sorted(Counter(q.reason for q in quarantined).items())),
        "quarantined_total": len(quarantined),
        "shards": shards,
        "seq_len": seq_len_summary(seq_lens),
        "mask_source": encoder.mask_source,
        # the same hashes every manifest records (provenance.tokenizer_identity), so they can be compared
        "chat_template_sha256": identity.get("chat_template_sha256"),
        "tokenizer_sha256": identity.get("tokenizer_sha256"),
    }
    faults.kill_point("tokenize.before_stats")
    write_json(stats_path, stats)
    print(
        f"tokenize: {n_in} conversations -> {len(seq_lens)} rows, {n_tokens} tokens "
        f"({stats['assistant_token_share']:.1%} assistant), {n_truncated} truncated, "
        f"{len(quarantined)} quarantined {stats['quarantined']}, {len(out_shards)} shards",
        file=sys.stderr,
    )
    return stats
