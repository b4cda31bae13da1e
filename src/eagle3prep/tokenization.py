"""The tokenize stage (DESIGN.md §3): normalized conversations -> contiguous shards of tokenized rows.

The loss mask is 1 exactly on assistant tokens. It comes from the chat template's
`{% generation %}` markers when the template has them, else (tokenize.template_fallback) from the
render boundary: for assistant turn i, the text between render(messages[:i], add_generation_prompt=True)
and render(messages[:i+1]), less trailing whitespace (template glue such as the "\\n" after
<|im_end|>). On the demo tokenizer both give the same mask.

Rows that keep no assistant token are quarantined with a reason, never dropped in silence. Row ids
are assigned in input order before sharding, so shard k is a contiguous row range.

Tool calling (assistant `tool_calls`, `tool` replies, the record's `tools`) is rendered by the template
like any turn: the mask covers the assistant's text and tool calls, not the tool results. A template
that fails on tool turns, or renders them without a call's name, a reply or a tool schema, quarantines
the conversation as `tool_turns_unsupported_by_template`: its hidden states would not be what is served.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import sys
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from eagle3prep import faults
from eagle3prep.atomic import TMP_PREFIX, atomic_open, write_json, write_jsonl
from eagle3prep.config import check_max_seq_len
from eagle3prep.errors import UserError
from eagle3prep.provenance import tokenizer_identity
from eagle3prep.records import Quarantined

# The test transformers itself uses to decide whether a template tracks generation spans.
GENERATION_RE = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
PROBE = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello, how can I help?"}]
BATCH_SIZE = 256  # conversations per render + batch-encode call
TOOL_REASON = "tool_turns_unsupported_by_template"


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

    The result is what `apply_chat_template(messages, tokenize=True, return_dict=True,
    return_assistant_tokens_mask=True)` gives one conversation at a time (tests/test_tokenization.py
    checks it), in fewer and cheaper steps: a batch is rendered in Python, encoded by one call into
    the Rust tokenizer, and masked from character spans without a Python loop over tokens.

    Args:
        tokenizer: a fast transformers tokenizer with a chat template.
        model_path: only for error messages.
        template_fallback: without `{% generation %}` markers, derive the mask from the render boundary.
    """

    def __init__(self, tokenizer, model_path: str | os.PathLike, template_fallback: bool = True):
        self.tokenizer = tokenizer
        self.template = get_chat_template(tokenizer, model_path)
        # The variables apply_chat_template hands the template (bos_token, eos_token, ...).
        self.template_kwargs = dict(tokenizer.special_tokens_map)
        # The Rust tokenizer is called directly; these are the settings `tokenizer(texts,
        # add_special_tokens=False)` gives it (PreTrainedTokenizerFast.set_truncation_and_padding).
        self.backend = tokenizer.backend_tokenizer
        self.backend.no_truncation()
        self.backend.no_padding()
        self.backend.encode_special_tokens = tokenizer.split_special_tokens
        # str(token id) for every id: looking it up is 3x faster than formatting it, row after row.
        self.id_str = [str(i) for i in range(max(self.backend.get_vocab(with_added_tokens=True).values()) + 1)]
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

    def encode(
        self, batch: list[list[dict[str, Any]]], tools: list[list[dict] | None] | None = None
    ) -> list[tuple[list[int], bytearray] | Rejected]:
        """One result per conversation: (input_ids, loss_mask as bytes 0/1), not truncated, or Rejected.
        `tools`: each conversation's tool schemas (or None), rendered by the template with its tool turns."""
        tools = tools or [None] * len(batch)
        agentic = [i for i, (m, t) in enumerate(zip(batch, tools, strict=True)) if t or has_tool_turns(m)]
        if not agentic:
            return self._encode_plain(batch)
        results: list = [None] * len(batch)
        plain = sorted(set(range(len(batch))) - set(agentic))
        for i, result in zip(plain, self._encode_plain([batch[i] for i in plain]), strict=True):
            results[i] = result
        for i in agentic:  # one at a time: the template gets each conversation's own tools
            results[i] = self._encode_agentic(batch[i], tools[i])
        return results

    def _encode_agentic(self, messages: list[dict[str, Any]], tools: list[dict] | None):
        try:
            text = self._render([messages], add_generation_prompt=False, tools=tools)[0]
            missing = dropped_tool_part(text, messages, tools)
            if missing:
                return Rejected(TOOL_REASON, f"the chat template does not render tool turns: {missing}")
            if self.mask_source == "generation_markers":
                return self._encode_markers([messages], tools)[0]
            return self._encode_boundary([messages], tools)[0]
        except Exception as e:  # a template may fail on tool turns in any way (TypeError on a None, ...)
            return Rejected(TOOL_REASON, f"the chat template cannot render tool turns: {type(e).__name__}: {e}")

    def _encode_plain(self, batch: list[list[dict[str, Any]]]) -> list[tuple[list[int], bytearray] | Rejected]:
        import jinja2

        if not batch:
            return []
        try:
            if self.mask_source == "generation_markers":
                return self._encode_markers(batch)
            return self._encode_boundary(batch)
        except jinja2.TemplateError as e:
            # One bad conversation (a template's raise_exception) must not sink its batch.
            if len(batch) == 1:
                return [Rejected("template_error", f"the chat template raised: {e}")]
            return [self._encode_plain([messages])[0] for messages in batch]

    def _encode_markers(self, batch, tools: list[dict] | None = None):
        # The renderer apply_chat_template uses, with the same arguments; it records the character
        # span of every {% generation %} block.
        from transformers.utils.chat_template_utils import render_jinja_template

        texts, spans = render_jinja_template(
            conversations=batch,
            tools=tools,
            chat_template=self.template,
            return_assistant_tokens_mask=True,
            **self.template_kwargs,
        )
        results = []
        for enc, span in zip(self.backend.encode_batch(texts, add_special_tokens=False), spans, strict=True):
            ids = enc.ids
            mask = bytearray(len(ids))
            # apply_chat_template's rule, kept exactly: from the token holding the block's first
            # character to the one holding its last (to the end when that one is not found).
            for start_char, end_char in span:
                start = enc.char_to_token(start_char)
                if start is None:
                    break
                end = enc.char_to_token(end_char - 1)
                end = end + 1 if end else len(ids)
                mask[start:end] = b"\x01" * (end - start)
            results.append((ids, mask))
        return results

    def _render(self, conversations: list[list[dict[str, Any]]], add_generation_prompt: bool, tools=None) -> list[str]:
        if not conversations:
            return []
        # A batched call also renders an empty history (the prompt before an opening assistant turn).
        return self.tokenizer.apply_chat_template(
            conversations, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode_boundary(self, batch, tools: list[dict] | None = None):
        import numpy as np

        # Renders per batch: the full conversations, every assistant turn's history with the generation
        # prompt, and every history including that turn.
        turns = [
            (b, i) for b, messages in enumerate(batch) for i, m in enumerate(messages) if m["role"] == "assistant"
        ]
        full = self._render(batch, add_generation_prompt=False, tools=tools)
        prompts = self._render([batch[b][:i] for b, i in turns], add_generation_prompt=True, tools=tools)
        with_turn = self._render([batch[b][: i + 1] for b, i in turns], add_generation_prompt=False, tools=tools)
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
        results = []
        for enc, span in zip(self.backend.encode_batch(full, add_special_tokens=False), spans, strict=True):
            if isinstance(span, Rejected):
                results.append(span)
                continue
            offsets = np.array(enc.offsets, dtype=np.int64).reshape(-1, 2)  # [T, 2] character [start, end)
            # A token is an assistant token when its characters overlap an assistant span.
            mask = np.zeros(len(offsets), dtype=bool)
            for s, e in span:
                mask |= (offsets[:, 0] < e) & (offsets[:, 1] > s)
            results.append((enc.ids, bytearray(mask.view(np.uint8))))
        return results


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def dropped_tool_part(text: str, messages: list[dict[str, Any]], tools: list[dict] | None) -> str | None:
    """What of the tool turns the rendered `text` lacks (a call's name or argument names, a tool reply, a tool
    schema's name), said in a few words; None when everything is there."""
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            args = fn["arguments"] if isinstance(fn["arguments"], dict) else {}
            for part in (fn["name"], *map(str, args)):
                if part not in text:
                    return f"messages[{i}] calls {fn['name']!r}, but {part!r} is not in the rendered text"
        if m["role"] == "tool" and m["content"].strip() not in text:
            return f"the tool reply of messages[{i}] is not in the rendered text"
    for j, tool in enumerate(tools or []):
        name = (tool.get("function") if isinstance(tool.get("function"), dict) else tool).get("name")
        if isinstance(name, str) and name not in text:
            return f"tool {j} ({name!r}) of the record's tools is not in the rendered text"
    return None


@dataclass(slots=True)
class EncodedChunk:
    """What the encoder makes of a chunk of input lines, ready for the parent to number and write."""

    rows: list[tuple[str, int] | Quarantined]  # per input line: (row JSON after `{"row":N,`, seq_len) or why not
    # Over loss-masked tokens of the kept rows: (token ids, counts), both [n_distinct] int64, ids ascending.
    # Sparse, so that a chunk of a 150k-token vocabulary does not ship 150k zeros.
    token_freq: tuple[Any, Any]
    n_truncated: int
    truncated_tokens: int = 0  # tokens cut from the truncated rows (what training loses)


def mask_runs(mask: bytearray) -> list[tuple[int, int]]:
    """The [start, end) token ranges where the loss mask is 1 (an assistant reply each, for a chat template)."""
    runs = []
    start = mask.find(1)
    while start >= 0:
        end = mask.find(0, start)
        if end < 0:
            end = len(mask)
        runs.append((start, end))
        start = mask.find(1, end)
    return runs


def row_json_tail(conv_id: str, ids: list[int], runs: list[tuple[int, int]], id_str: list[str]) -> str:
    """`json.dumps(TokenizedRow(...).to_json(), ensure_ascii=False, separators=(",", ":"))` + newline, from
    the key after "row" on: the row number is known only in input order, in the parent. The loss mask is
    given as its `mask_runs`: it is written a run at a time, not a digit at a time."""
    mask, prev = [], 0
    for start, end in runs:
        mask += ("0," * (start - prev), "1," * (end - start))
        prev = end
    mask.append("0," * (len(ids) - prev))
    return (
        f'"id":{json.dumps(conv_id, ensure_ascii=False)},"input_ids":[{",".join(map(id_str.__getitem__, ids))}],'
        f'"loss_mask":[{"".join(mask)[:-1]}],"seq_len":{len(ids)}}}\n'
    )


def encode_lines(
    encoder: ChatEncoder, conversations_path: str, lines: list[tuple[int, str]], max_seq_len: int
) -> EncodedChunk:
    """Parse, encode, truncate, quarantine and serialize a chunk of (1-based line, text) of the prepare output."""
    import numpy as np

    convs = [parse_conversation(conversations_path, line_no, line) for line_no, line in lines]
    results = encoder.encode([conv["messages"] for conv in convs], [conv.get("tools") for conv in convs])
    rows: list[tuple[str, int] | Quarantined] = []
    masked: list[int] = []  # the loss-masked token ids of the chunk's kept rows, counted once at the end
    n_truncated = truncated_tokens = 0
    for (line_no, _), conv, result in zip(lines, convs, results, strict=True):
        if isinstance(result, Rejected):
            rows.append(Quarantined(conversations_path, line_no, result.reason, result.detail, conv))
            continue
        ids, mask = result
        full_len = len(ids)
        if full_len > max_seq_len:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        runs = mask_runs(mask)
        if not runs:
            where = f" within the first {max_seq_len} of {full_len} tokens" if full_len > max_seq_len else ""
            rows.append(
                Quarantined(
                    conversations_path, line_no, "no_assistant_tokens",
                    f"no assistant token{where} after applying the chat template", conv,
                )
            )  # fmt: skip
            continue
        n_truncated += full_len > max_seq_len
        truncated_tokens += max(full_len - max_seq_len, 0)
        for start, end in runs:
            masked += ids[start:end]
        rows.append((row_json_tail(conv["id"], ids, runs, encoder.id_str), len(ids)))
    # One bincount instead of a Counter.update per row: half the time (Counter hashes every token).
    counts = np.bincount(np.fromiter(masked, dtype=np.int64, count=len(masked)))
    distinct = np.flatnonzero(counts)
    return EncodedChunk(rows, (distinct, counts[distinct]), n_truncated, truncated_tokens)


_WORKER: tuple[ChatEncoder, str, int] | None = None


def _init_worker(
    conversations_path: str, max_seq_len: int, model_path, template_fallback: bool, trust_remote_code: bool
):
    global _WORKER
    # Ctrl-C reaches the whole process group: the parent stops the job with one line; a worker's
    # KeyboardInterrupt would add a traceback per worker to the log.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One Rust thread per worker process (unless set otherwise): the workers already fill the cores
    # (tokenize.workers is about one per core), and rayon threads on top would only contend with them.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    encoder = ChatEncoder(load_tokenizer(model_path, trust_remote_code), model_path, template_fallback)
    _WORKER = (encoder, conversations_path, max_seq_len)


def _encode_in_worker(lines: list[tuple[int, str]]) -> EncodedChunk:
    encoder, conversations_path, max_seq_len = _WORKER
    return encode_lines(encoder, conversations_path, lines, max_seq_len)


def encode_chunks(
    chunks: Iterator[list[tuple[int, str]]],
    encoder: ChatEncoder,
    conversations_path: str,
    max_seq_len: int,
    workers: int,
    load_args: tuple,
) -> Iterator[EncodedChunk]:
    """Encoded chunks in input order; with workers > 1 the chunks are encoded in worker processes.

    A chunk travels as its raw lines and comes back as finished JSON text, so the parent only numbers
    and writes rows. At most 2 x workers chunks are in flight: memory stays bounded by the chunk, not
    the dataset. Processes, not threads: rendering, masking and serializing are Python (a quarter of
    the CPU time; the Rust encode is the rest). `load_args` are (model_path, template_fallback,
    trust_remote_code), for each worker to build its encoder.
    """
    if workers <= 1:
        for lines in chunks:
            yield encode_lines(encoder, conversations_path, lines, max_seq_len)
        return
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor

    init_args = (conversations_path, max_seq_len, *load_args)
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=init_args) as pool:
        pending: deque = deque()
        for lines in chunks:
            pending.append(pool.submit(_encode_in_worker, lines))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def parse_conversation(path: str, line_no: int, line: str) -> dict[str, Any]:
    """The Conversation JSON of one line of the prepare stage's output."""
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
    return conv


def batched(items: Iterator, n: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def copy_lines(src: BinaryIO, dst: BinaryIO, n: int, block: int = 1 << 20) -> None:
    """Copy the next `n` lines of `src` to `dst` a block at a time: newlines are found by bytes.count and
    bytes.index, not by a readline and a write per row (those took half the time after the last chunk)."""
    while n > 0:
        buf = src.read(block)
        if not buf:
            raise EOFError(f"{n} lines short: the spill file holds fewer rows than were counted")
        found = buf.count(b"\n")
        if found < n:
            dst.write(buf)
            n -= found
            continue
        end = -1
        for _ in range(n):
            end = buf.index(b"\n", end + 1)
        dst.write(memoryview(buf)[: end + 1])
        src.seek(end + 1 - len(buf), os.SEEK_CUR)  # the rest of the block belongs to the next shard
        n = 0


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


def no_rows_error(quarantined: list[Quarantined], max_seq_len: int) -> TokenizeError:
    """Every conversation was quarantined: one line with the reasons and the first records, since the
    failed job's folder (and its quarantine.jsonl) is removed by Snakemake."""
    reasons = ", ".join(f"{r} {n}" for r, n in sorted(Counter(q.reason for q in quarantined).items()))

    def where(q: Quarantined) -> str:  # the raw record's file:line when prepare recorded it
        source = q.record.get("source") if isinstance(q.record, dict) else None
        return f"{source} ({q.file} line {q.line})" if source else f"{q.file} line {q.line}"

    first = "; ".join(f"{where(q)}: {q.reason}: {q.detail}" for q in quarantined[:3])
    hint = (
        f"; raise tokenize.max_seq_len ({max_seq_len}) if the replies fall past it"
        if any("within the first" in q.detail for q in quarantined)
        else ""
    )
    return TokenizeError(
        f"tokenize kept no row: all {len(quarantined)} conversations were quarantined ({reasons}), e.g. {first}{hint}"
    )


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
            template_not_prefix_stable, template_error, tool_turns_unsupported_by_template).
        max_seq_len: rows longer than this are truncated (and counted).

    Returns:
        The stats dict also written to `stats_path`.
    """
    import numpy as np

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
    token_freq = np.zeros(len(encoder.id_str), dtype=np.int64)  # [vocab] count of each token id, loss-masked
    quarantined: list[Quarantined] = []
    n_in = n_truncated = truncated_tokens = 0

    # Rows go to a spill file first: how many rows each shard gets is known only at the end, and
    # host memory must not grow with the dataset.
    spill_dir = Path(out_shards[0]).parent
    spill_dir.mkdir(parents=True, exist_ok=True)
    # A fixed name: a killed run's spill is overwritten by the rerun, then removed, not left behind.
    spill = spill_dir / f"{TMP_PREFIX}tokenize-spill.jsonl"
    try:
        with open(spill, "w", encoding="utf-8") as spill_f, open(conversations_path, encoding="utf-8") as src:
            chunks = batched(enumerate(src, start=1), batch_size)
            load_args = (model_path, template_fallback, trust_remote_code)
            for chunk in encode_chunks(chunks, encoder, str(conversations_path), max_seq_len, workers, load_args):
                for item in chunk.rows:
                    n_in += 1
                    faults.kill_point("tokenize.mid_stream", rows_in=n_in)
                    if isinstance(item, Quarantined):
                        quarantined.append(item)
                        continue
                    tail, seq_len = item
                    spill_f.write(f'{{"row":{len(seq_lens)},{tail}')
                    seq_lens.append(seq_len)
                distinct, counts = chunk.token_freq
                token_freq[distinct] += counts
                n_truncated += chunk.n_truncated
                truncated_tokens += chunk.truncated_tokens

        shards = []
        with open(spill, "rb") as spill_f:
            for k, (start, end) in enumerate(shard_ranges(len(seq_lens), len(out_shards))):
                # Lines are copied as written: the same format as atomic.write_jsonl.
                with atomic_open(out_shards[k], "wb") as f:
                    copy_lines(spill_f, f, end - start)
                shards.append(
                    {"shard": k, "path": str(out_shards[k]), "first_row": start, "rows": end - start,
                     "tokens": sum(seq_lens[start:end])}
                )  # fmt: skip
                faults.kill_point("tokenize.between_shards", shard=k)
    finally:
        with contextlib.suppress(FileNotFoundError):
            spill.unlink()

    assert n_in == len(seq_lens) + len(quarantined), "rows in != rows out + quarantined"
    if n_in and not seq_lens:
        raise no_rows_error(quarantined, max_seq_len)
    n_tokens, n_assistant = sum(seq_lens), int(token_freq.sum())
    write_jsonl(quarantine_path, (q.to_json() for q in quarantined))
    distinct = np.flatnonzero(token_freq)  # ascending token ids
    write_json(token_freq_path, dict(zip(map(str, distinct.tolist()), token_freq[distinct].tolist(), strict=True)))
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
        "truncated_tokens": truncated_tokens,
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
