"""The tokenize driver: every conversation encoded in input order, rows numbered and spilled to one file, the
spill cut into contiguous shards, then quarantine, token counts and stats written."""

from __future__ import annotations

import contextlib
import math
import os
from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Self

from eagle3prep.config.model import check_max_seq_len
from eagle3prep.infra import faults
from eagle3prep.infra.atomic import TMP_PREFIX, atomic_open, write_json, write_jsonl
from eagle3prep.infra.provenance import tokenizer_identity
from eagle3prep.prepare.counts import require_conversations
from eagle3prep.records import Quarantined
from eagle3prep.tokenize.template import ChatEncoder, TokenizeError, load_tokenizer
from eagle3prep.tokenize.workers import batched, encode_chunks

from ..infra.log import get_logger

if TYPE_CHECKING:
    from eagle3prep.settings import TokenizeSettings

log = get_logger("tokenize")

BATCH_SIZE = 256  # conversations per render + batch-encode call


@dataclass(frozen=True, slots=True)
class TokenizePaths:
    """The tokenize job's files: prepare's (or regenerate's) three outputs in, the tokenized folder out."""

    conversations_path: str | os.PathLike
    counts_path: str | os.PathLike  # read first: no conversation kept stops the job, naming the sources
    prepare_quarantine: str | os.PathLike
    out_dir: str | os.PathLike  # stats.json, token_freq.json and quarantine.jsonl go here
    out_shards: Sequence[str | os.PathLike]  # shard_{k}.jsonl for every k
    model_path: str | os.PathLike


@dataclass(frozen=True, slots=True)
class TokenizeJobSettings:
    """What the tokenize job reads: `tokenize:`, and `workers`, the job's Snakemake threads (the worker
    processes it encodes in, capped by --cores)."""

    tokenize: TokenizeSettings
    trust_remote_code: bool
    workers: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, workers: int) -> Self:
        from eagle3prep.settings import TokenizeSettings

        return cls(TokenizeSettings.from_config(config), config["model"]["trust_remote_code"], workers)


def run_tokenize_job(paths: TokenizePaths, settings: TokenizeJobSettings) -> dict[str, Any]:
    """The tokenize stage's job: the conversations (prepare's or regenerate's; none kept stops here, naming the
    sources and the quarantine) rendered by `settings` into `out_shards`, with stats.json, token_freq.json and
    quarantine.jsonl in `out_dir`."""
    p, s = paths, settings.tokenize
    require_conversations(p.counts_path, p.prepare_quarantine)
    return tokenize_conversations(
        p.conversations_path, p.model_path, list(p.out_shards),
        f"{p.out_dir}/stats.json", f"{p.out_dir}/token_freq.json", f"{p.out_dir}/quarantine.jsonl",
        s.max_seq_len, template_fallback=s.template_fallback, trust_remote_code=settings.trust_remote_code,
        workers=settings.workers, chat_template_kwargs=s.chat_template_kwargs,
    )  # fmt: skip


def tokenize_conversations(
    conversations_path: str | os.PathLike,
    model_path: str | os.PathLike,
    out_shards: list[str | os.PathLike],
    stats_path: str | os.PathLike,
    token_freq_path: str | os.PathLike,
    quarantine_path: str | os.PathLike,
    max_seq_len: int,
    *,
    template_fallback: bool,
    trust_remote_code: bool,
    workers: int,
    chat_template_kwargs: Mapping[str, Any],
    batch_size: int = BATCH_SIZE,
) -> dict[str, Any]:
    """Tokenize every conversation with the target's chat template into len(out_shards) contiguous shards.

    Args:
        conversations_path: the prepare stage's JSONL, one `Conversation.to_json()` a line.
        model_path: the target model folder (its tokenizer and chat template are used).
        out_shards: shard k's JSONL path (`TokenizedRow.to_json()` a line); every one is written, maybe empty.
        stats_path: JSON summary (row/token counts, truncation, quarantine reasons, per-shard sizes, hashes).
        token_freq_path: JSON {token_id: count} over loss-masked tokens (speculators' token_freq.pt semantics).
        quarantine_path: JSONL of `Quarantined` records (reasons: no_assistant_tokens,
            template_not_prefix_stable, template_error, tool_turns_unsupported_by_template; for rows with
            images: images_unsupported_by_target, image_missing, image_changed, image_cut_by_max_seq_len;
            on a vision-language target, text that writes a vision placeholder itself: media_token_in_text).
        max_seq_len: rows longer than this are truncated (and counted).
        chat_template_kwargs: extra template variables for every render (tokenize.chat_template_kwargs).

    Returns:
        The stats dict also written to `stats_path`.
    """
    if not out_shards:
        raise TokenizeError("out_shards is empty; tokenize.num_shards must be at least 1")
    encoder = _load_encoder(model_path, max_seq_len, template_fallback, trust_remote_code, chat_template_kwargs)
    identity = tokenizer_identity(str(model_path))
    tally = _Tally(len(encoder.id_str))
    load_args = (model_path, template_fallback, trust_remote_code, encoder.chat_template_kwargs)
    shards = _encode_into_shards(conversations_path, out_shards, encoder, max_seq_len, batch_size, workers,
                                 load_args, tally)  # fmt: skip

    assert tally.n_in == len(tally.seq_lens) + len(tally.quarantined), "rows in != rows out + quarantined"
    if tally.n_in and not tally.seq_lens:
        raise no_rows_error(tally.quarantined, max_seq_len)
    write_jsonl(quarantine_path, (q.to_json() for q in tally.quarantined))
    write_json(token_freq_path, tally.token_freq_json())
    stats = _stats(tally, conversations_path, model_path, max_seq_len, shards, encoder, identity)
    faults.kill_point("tokenize.before_stats")
    write_json(stats_path, stats)
    log.info(
        f"{tally.n_in} conversations -> {stats['rows']} rows, {stats['tokens']} tokens "
        f"({stats['assistant_token_share']:.1%} assistant), {tally.n_truncated} truncated, "
        f"{len(tally.quarantined)} quarantined {stats['quarantined']}, {len(out_shards)} shard{'s' * (len(out_shards) != 1)}"
    )
    return stats


def _encode_into_shards(conversations_path, out_shards, encoder: ChatEncoder, max_seq_len: int, batch_size: int,
                        workers: int, load_args: tuple, tally: _Tally) -> list[dict[str, Any]]:  # fmt: skip
    """Encode every conversation into `tally` and the shards; the shards' entries for stats.json."""
    # Rows go to a spill file first: how many rows each shard gets is known only at the end, and
    # host memory must not grow with the dataset.
    spill_dir = Path(out_shards[0]).parent
    spill_dir.mkdir(parents=True, exist_ok=True)
    # A fixed name: a killed run's spill is overwritten by the rerun, then removed, not left behind.
    spill = spill_dir / f"{TMP_PREFIX}tokenize-spill.jsonl"
    try:
        _spill_rows(spill, conversations_path, encoder, max_seq_len, batch_size, workers, load_args, tally)
        return _write_shards(spill, out_shards, tally.seq_lens)
    finally:
        with contextlib.suppress(FileNotFoundError):
            spill.unlink()


def _load_encoder(
    model_path, max_seq_len: int, template_fallback: bool, trust_remote_code: bool, chat_template_kwargs
) -> ChatEncoder:
    """The target's ChatEncoder, after checking max_seq_len against the model's config (an error) and the
    tokenizer's model_max_length (a warning)."""
    tokenizer = load_tokenizer(model_path, trust_remote_code)
    check_max_seq_len(max_seq_len, model_path)
    encoder = ChatEncoder(tokenizer, model_path, template_fallback, chat_template_kwargs)
    if max_seq_len > tokenizer.model_max_length:
        log.warning(
            f"warning: max_seq_len {max_seq_len} is above the tokenizer's model_max_length "
            f"{tokenizer.model_max_length} ({model_path}); the model may not take rows that long"
        )
    return encoder


@dataclass
class _Tally:
    """What the encoded chunks add up to: each kept row's length (its index is its row number), the quarantine,
    and the loss-masked token counts."""

    vocab_size: int
    seq_lens: array = field(default_factory=lambda: array("q"))
    quarantined: list[Quarantined] = field(default_factory=list)
    n_in: int = 0
    n_truncated: int = 0
    truncated_tokens: int = 0
    trailing_user: int = 0  # kept rows that end with a user message
    images: list[int] = field(default_factory=lambda: [0, 0, 0])  # rows with images, images, vision tokens
    token_freq: Any = None  # [vocab] int64 count of each token id, loss-masked

    def __post_init__(self):
        """Start every token count at zero, one per vocabulary id."""
        import numpy as np

        self.token_freq = np.zeros(self.vocab_size, dtype=np.int64)

    def token_freq_json(self) -> dict[str, int]:
        """token_freq.json: {token id: count} for every id that occurs, ids ascending."""
        import numpy as np

        distinct = np.flatnonzero(self.token_freq)
        return dict(zip(map(str, distinct.tolist()), self.token_freq[distinct].tolist(), strict=True))


def _spill_rows(spill: Path, conversations_path, encoder, max_seq_len, batch_size, workers, load_args, tally):
    """Encode every conversation and write the kept rows, numbered in input order, to `spill`; add up the
    rest in `tally`."""
    with open(spill, "w", encoding="utf-8") as spill_f, open(conversations_path, encoding="utf-8") as src:
        chunks = batched(enumerate(src, start=1), batch_size)
        for chunk in encode_chunks(chunks, encoder, str(conversations_path), max_seq_len, workers, load_args):
            for item in chunk.rows:
                tally.n_in += 1
                faults.kill_point("tokenize.mid_stream", rows_in=tally.n_in)
                if isinstance(item, Quarantined):
                    tally.quarantined.append(item)
                    continue
                tail, seq_len = item
                spill_f.write(f'{{"row":{len(tally.seq_lens)},{tail}')
                tally.seq_lens.append(seq_len)
            distinct, counts = chunk.token_freq
            tally.token_freq[distinct] += counts
            tally.n_truncated += chunk.n_truncated
            tally.truncated_tokens += chunk.truncated_tokens
            tally.trailing_user += chunk.trailing_user
            tally.images = [a + b for a, b in zip(tally.images, chunk.images, strict=True)]


def _write_shards(spill: Path, out_shards: list, seq_lens: array) -> list[dict[str, Any]]:
    """Cut the spill into len(out_shards) contiguous row ranges, each written atomically; their stats entries."""
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
    return shards


def _stats(tally: _Tally, conversations_path, model_path, max_seq_len, shards, encoder, identity) -> dict:
    """stats.json: row and token counts, truncation, quarantine reasons, shards, lengths, what the rows were
    rendered with (mask source, tokenizer and template hashes, template kwargs)."""
    n_tokens, n_assistant = sum(tally.seq_lens), int(tally.token_freq.sum())
    image_rows, n_images, image_tokens = tally.images
    # Only where rows have images: text-only runs keep their stats.json bytes.
    images = {
        "image_rows": image_rows, "images": n_images, "image_tokens": image_tokens,
        "image_token_share": round(image_tokens / n_tokens, 6) if n_tokens else 0.0,
    } if image_rows else {}  # fmt: skip
    return {
        "conversations_path": str(conversations_path),
        "model_path": str(model_path),
        "conversations_in": tally.n_in,
        "rows": len(tally.seq_lens),
        "tokens": n_tokens,
        "assistant_tokens": n_assistant,
        "assistant_token_share": round(n_assistant / n_tokens, 6) if n_tokens else 0.0,
        "max_seq_len": max_seq_len,
        "truncated_rows": tally.n_truncated,
        "truncated_tokens": tally.truncated_tokens,
        # Only when there are some, like the image counts: other runs keep their stats.json bytes.
        **({"trailing_user_rows": tally.trailing_user} if tally.trailing_user else {}),
        **images,
        "quarantined": dict(sorted(Counter(q.reason for q in tally.quarantined).items())),
        "quarantined_total": len(tally.quarantined),
        "shards": shards,
        "seq_len": seq_len_summary(tally.seq_lens),
        "mask_source": encoder.mask_source,
        # the same hashes every manifest records (provenance.tokenizer_identity), so they can be compared
        "chat_template_sha256": identity.get("chat_template_sha256"),
        "tokenizer_sha256": identity.get("tokenizer_sha256"),
        # the template renders with these too: its hash alone does not say what was rendered
        "chat_template_kwargs": encoder.chat_template_kwargs,
    }


def copy_lines(src: BinaryIO, dst: BinaryIO, n: int, block: int = 1 << 20) -> None:
    """Copy the next `n` lines of `src` to `dst` a block at a time, newlines found by bytes.count and
    bytes.index: a readline and a write per row was slower (bench/bench_cpu_stages.py)."""
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
    """min, mean, p50, p95 and max of the kept rows' lengths (nearest-rank percentiles); None without rows."""
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
