"""What the driver feeds the engine of one shard (DESIGN.md §5): each row's tag, sampling params and logits-check
request, the requests of rows with images made ahead on a pool, the prompt add_request is given, and the check of
what vLLM expanded; and ShardRun, what one shard on its way through the engine counts. loop.py runs the phases."""

from __future__ import annotations

import collections
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ...infra.log import get_logger
from ...tokenize.row_inputs import ImageRow
from .. import registry
from . import images
from .requests import CaptureError, Probe, logprob_request, sampling_params

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from ...shard.sink import SinkSpec

# A shard of TAIL_PARTS steps or more gets its last step_tokens at most step_tokens / TAIL_PARTS at a time
# (submit_rows): the tail after the last forward (write, sha256 and fsync of its rows) shrinks with that step.
TAIL_PARTS = 4

log = get_logger("vllm backend").info  # the capture's lines, every path's


class Row(NamedTuple):
    """A row as the submission loop takes it: for a row with images, `ready` is the future of its request."""

    tag: str
    params: Any
    ids: list[int]
    ready: Future | None
    batch_end: bool  # the last row of its batch: the loop may step the engine after it
    probe: Probe | None = None  # its logits check's prefix request, added right after it


@dataclass(slots=True)
class ShardRun:
    """One shard on its way through the engine: what was added, what is in flight, and where the driver's thread
    went (with images it can set the pace)."""

    spec: SinkSpec
    engine: Any  # vLLM's LLMEngine
    wanted: dict[str, int]  # request tag -> shard row, of the requests whose prompt logprobs are kept
    unsent: int  # prompt tokens of the shard not added yet
    in_flight: int = 0  # prompt tokens added whose request has not ended
    submitted: int = 0  # rows added
    probes: list[str] = field(default_factory=list)  # the logits check's prefix requests added
    # opening the worker's sink, waiting for the image threads' requests, adding requests, in engine steps, then the
    # shard's tail (drain: its last rows reach the sink; finish: the sink seals the files)
    clock: dict[str, float] = field(
        default_factory=lambda: {"driver_wait_s": 0.0, "driver_add_s": 0.0, "driver_step_s": 0.0}
    )
    made_s: list[float] = field(default_factory=list)  # the image threads' seconds making each request
    image_rows: dict[str, list[int]] = field(default_factory=dict)  # tag -> ids of a row with images, until it ends
    logprob_notes: list[str] = field(default_factory=list)  # logits-check rows covered in part or not at all

    @property
    def tapered(self) -> bool:
        """A long shard's last step_tokens go in a few rows at a time (smaller steps for a quarter at most)."""
        return self.spec.total_tokens >= TAIL_PARTS * self.spec.step_tokens

    def window(self, window_tokens: int) -> tuple[int, bool]:
        """The prompt tokens the engine may hold now, and whether the shard is in its tail."""
        tail = self.tapered and self.unsent < self.spec.step_tokens
        return (max(1, self.spec.step_tokens // TAIL_PARTS) if tail else window_tokens), tail


def row_params(run: ShardRun, index: int, ids: list[int]) -> tuple[str, Any, Probe | None]:
    """The tag and sampling params of the shard's row `index`, and its logits check's prefix request if any
    (`run.wanted` then maps the prefix request's tag to the row)."""
    tag = run.spec.tag(index)
    if tag not in run.wanted:
        return tag, sampling_params(tag), None
    params, probe, note = logprob_request(tag, ids)
    if note:
        run.logprob_notes.append(note)
        log(note)
    if probe is not None or note:  # the row's own request returns no logprobs
        row = run.wanted.pop(tag)
        if probe is not None:
            run.wanted[probe.tag] = row
    return tag, params, probe


def prefetched(
    batches: Iterator[list[list[int]]],
    engine: Any,
    params_of: Callable[[int, list[int]], tuple[str, Any, Probe | None]],
    version: str,
    model_path: str,
) -> Iterator[Row]:
    """Each row in order, with its tag and params and whether it ends its batch. A row with images is made
    ready on a pool (images.RequestPool), at most AHEAD_ROWS rows ahead of the one handed out: its
    images loaded and its request made by vLLM's input processor (images.request_maker), so the driver's
    thread only adds it. The pool is made on the first row with images (a text-only shard starts none) and
    closed when the generator ends or is closed."""
    import torch

    pool: images.RequestPool | None = None
    # vLLM's processor sets torch's (process-wide) thread count around each call and puts it back: calls on
    # several threads at once can leave another count behind, so the pool's end puts the first one back
    torch_threads = 0
    ahead: collections.deque[Row] = collections.deque()

    def ready(ids: list[int], tag: str, params: Any) -> Future | None:
        nonlocal pool, torch_threads
        if not isinstance(ids, ImageRow):
            return None
        if pool is None:
            torch_threads = torch.get_num_threads()
            pool = images.RequestPool(images.request_maker(engine, version), model_path)
        return pool.submit(ids, tag, params)

    done = False
    try:
        index = 0
        for batch in batches:
            for k, ids in enumerate(batch):
                tag, params, probe = params_of(index, ids)
                ahead.append(Row(tag, params, ids, ready(ids, tag, params), k == len(batch) - 1, probe))
                index += 1
                if len(ahead) > images.AHEAD_ROWS:
                    yield ahead.popleft()
        while ahead:
            yield ahead.popleft()
        done = True
    finally:
        if pool is not None:
            pool.close(abandon=not done)  # closed early (a failure): nothing more is waited for
            torch.set_num_threads(torch_threads)


def prompt(run: ShardRun, row: Row) -> Any:
    """What add_request is given: a text row's token ids, or the request the pool made of a row with images
    (images.make_request; the row's ids kept to check what vLLM expanded when it ends)."""
    if row.ready is None:
        return registry.load("TokensPrompt")(prompt_token_ids=list(row.ids))
    run.image_rows[row.tag] = list(row.ids)
    t0 = time.perf_counter()
    try:
        request, made_s = row.ready.result(timeout=images.WAIT_S)
    except TimeoutError:
        raise CaptureError(
            f"request {row.tag}: no image worker made it in {images.WAIT_S:.0f} s (a worker is stuck)"
        ) from None
    run.clock["driver_wait_s"] += time.perf_counter() - t0
    run.made_s.append(made_s)
    return request


def check_expansion(run: ShardRun, out: Any) -> None:
    """A row with images must reach the model as tokenize wrote it: vLLM's processor may not re-expand it."""
    if not run.image_rows:  # a text-only shard: nothing to compare
        return
    tag = registry.member(out, "RequestOutput.request_id")
    want = run.image_rows.pop(tag, None)
    got = list(registry.member(out, "RequestOutput.prompt_token_ids") or ())
    if want is not None and got != want:
        raise CaptureError(
            f"request {tag}: vLLM's processor made {len(got)} prompt tokens of the row's {len(want)} "
            "(its images expanded differently than tokenize expanded them): re-run tokenize with this model.path"
        )
