"""Where chunks are encoded: in this process, or in tokenize.workers worker processes that each load their
own encoder; either way the chunks come back in input order."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator

from eagle3prep.tokenize.rows import EncodedChunk, encode_lines
from eagle3prep.tokenize.template import ChatEncoder, load_tokenizer

_WORKER: tuple[ChatEncoder, str, int] | None = None  # a worker process's (encoder, conversations path, max_seq_len)


def _init_worker(
    conversations_path: str,
    max_seq_len: int,
    model_path,
    template_fallback: bool,
    trust_remote_code: bool,
    chat_template_kwargs: dict,
):
    """Set up one worker process: its own encoder, and the process settings that keep it quiet and lean."""
    global _WORKER
    # Ctrl-C reaches the whole process group: the parent stops the job with one line; a worker's
    # KeyboardInterrupt would add a traceback per worker to the log.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One Rust thread per worker process (unless set otherwise): the workers already fill the cores
    # (tokenize.workers is about one per core), and rayon threads on top would only contend with them.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # One torch thread too (image processors on torchvision run torch ops): forked from a process whose OpenMP
    # team already ran (a model built or run there), a parallel region here waits forever (libgomp, not fork-safe).
    if (torch := sys.modules.get("torch")) is not None:
        torch.set_num_threads(1)
    tokenizer = load_tokenizer(model_path, trust_remote_code)
    encoder = ChatEncoder(tokenizer, model_path, template_fallback, chat_template_kwargs)
    _WORKER = (encoder, conversations_path, max_seq_len)


def _encode_in_worker(lines: list[tuple[int, str]]) -> EncodedChunk:
    """encode_lines with the worker's own encoder (what the pool calls per chunk)."""
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
    """Encoded chunks in input order; with workers > 1 in worker processes, at most 2 x workers chunks in
    flight so that memory follows the chunk, not the dataset (DESIGN.md §3 says why processes).
    `load_args` are (model_path, template_fallback, trust_remote_code, chat_template_kwargs), for each worker to
    build its encoder."""
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


def batched(items: Iterator, n: int) -> Iterator[list]:
    """`items` in lists of `n` (the last one shorter): the chunks that are encoded together."""
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch
