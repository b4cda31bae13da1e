"""The driver's half of a shard, the same on both capture paths (DESIGN.md §5): open the worker's sink, stream the
rows' requests in (no batch barrier), step the engine until every request ended, wait for the worker to hold every
row, and ask it to finish the shard. Each path (hooks/path.py, builtin/path.py) adds its engine kwargs, its install
call and its wait for the rows.

One function a phase: open_shard, submit_rows (with add_row and step), drain_engine, finish_shard; abort_shard when
any of them fails. What they count is one ShardRun.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ...errors import UserError
from ...infra.log import get_logger
from ...tokenize.row_inputs import ImageRow
from .. import registry
from . import images, message
from .requests import CaptureError, Probe, logprob_request, prompt_logprobs, sampling_params

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from ...shard.sink import SinkSpec

# A shard of TAIL_PARTS steps or more gets its last step_tokens at most step_tokens / TAIL_PARTS at a time
# (submit_rows): the tail after the last forward (write, sha256 and fsync of its rows) shrinks with that step.
TAIL_PARTS = 4


log = get_logger("vllm backend").info


class WorkerUserError(UserError):
    """A UserError raised in the vLLM worker (a full disk), passed on with its message."""


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

    @property
    def tapered(self) -> bool:
        """A long shard's last step_tokens go in a few rows at a time (smaller steps for a quarter at most)."""
        return self.spec.total_tokens >= TAIL_PARTS * self.spec.step_tokens

    def window(self, window_tokens: int) -> tuple[int, bool]:
        """The prompt tokens the engine may hold now, and whether the shard is in its tail."""
        tail = self.tapered and self.unsent < self.spec.step_tokens
        return (max(1, self.spec.step_tokens // TAIL_PARTS) if tail else window_tokens), tail


def engine_in_process(engine: Any) -> bool:
    """LLMEngine's engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so nothing steps
    it unless the driver does. Its client is InprocClient in vLLM's V1 engine (0.8 through 0.32)."""
    client = registry.member(engine, "LLMEngine.engine_core")
    return type(client).__name__ == registry.entry("InprocClient").path


class WorkerSinkPath:
    """The driver's half of a path whose sink runs in TP rank 0's worker: stream requests in, finish."""

    name = ""

    def __init__(self, layer_ids: list[int], version: str, model_path: str = ""):
        self.layer_ids = layer_ids
        self.version = version
        self.model_path = model_path  # the target's folder: its image processor checks a row's images
        self.window_tokens = 0  # set by the driver once the engine's step size is known
        self.logprobs: dict[int, Any] = {}
        self.logprob_notes: list[str] = []  # logits-check rows covered in part or not at all (logprob_request)
        self.stats: dict[str, Any] = {}  # the worker's sink timings of the last shard
        self.run: ShardRun | None = None  # the shard being captured

    # ---- what each path adds ----
    def prepare_environment(self) -> None:
        """Set what the engine must read from the environment when it starts."""

    def engine_kwargs(self) -> dict[str, Any]:
        raise NotImplementedError

    def install(self, llm: Any) -> None:
        raise NotImplementedError

    def wait_for_rows(self, llm: Any, run: ShardRun) -> None:
        """Wait until the worker holds every row (the hooks have them when the last request ends)."""

    # ---- the shard ----
    def capture_shard(self, llm: Any, batches: Iterator[list[list[int]]], spec: SinkSpec) -> dict[int, dict[str, Any]]:
        """Rows are fed to the engine as a stream, at most `window_tokens` prompt tokens in flight,
        so the scheduler always has a full step and no batch boundary leaves the GPU idle; a long shard's last
        step_tokens at most step_tokens / TAIL_PARTS at a time."""
        run = self.run = self.open_shard(llm, spec)
        try:
            self.submit_rows(run, batches)
            self.drain_engine(run)
            reply = self.finish_shard(llm, run)
        except BaseException:  # interrupted or failed: drop the requests and the worker's temp files
            self.abort_shard(llm, run)
            raise
        return self.entries(reply, run)

    def open_shard(self, llm: Any, spec: SinkSpec) -> ShardRun:
        """The worker's sink opened for `spec`, and the shard's run."""
        t0 = time.perf_counter()
        message.call(llm, "e3p_open_shard", message.spec_to_wire(spec), version=self.version)
        engine = registry.member(llm, "LLM.llm_engine", version=self.version)
        run = ShardRun(spec, engine, wanted={spec.tag(r): r for r in spec.logprob_rows}, unsent=spec.total_tokens)
        run.clock["open_s"] = time.perf_counter() - t0
        self.logprobs, self.logprob_notes = {}, []
        return run

    def submit_rows(self, run: ShardRun, batches: Iterator[list[list[int]]]) -> None:
        """Every row's request added, the engine stepped whenever more than the window is in flight."""
        params_of = functools.partial(self._params, run)
        with contextlib.closing(self._prefetched(batches, run.engine, params_of)) as rows:  # closed: threads end here
            for row in rows:
                self.add_row(run, row)
                # The last step's rows reach the files after its forward, where nothing overlaps them: the
                # shard's last step_tokens go in a few rows at a time, so that step (and the tail) is small.
                window, tail = run.window(self.window_tokens)
                while (row.batch_end or tail) and run.in_flight > window and self._unfinished(run):
                    run.in_flight -= self.step(run)

    def add_row(self, run: ShardRun, row: Row) -> None:
        """One row's request added to the engine, and its logits check's prefix request after it."""
        prompt = self._prompt(run, row)
        add_request = registry.member(run.engine, "LLMEngine.add_request", version=self.version)
        t0 = time.perf_counter()
        add_request(row.tag, prompt, row.params)
        if row.probe is not None:
            tokens_prompt = registry.load("TokensPrompt")
            add_request(row.probe.tag, tokens_prompt(prompt_token_ids=row.probe.ids), row.probe.params)
            run.probes.append(row.probe.tag)
            run.in_flight += len(row.probe.ids)
        run.clock["driver_add_s"] += time.perf_counter() - t0
        run.submitted += 1
        run.in_flight += len(row.ids)
        run.unsent -= len(row.ids)

    def step(self, run: ShardRun) -> int:
        """One engine step; the prompt tokens of the requests it finished (their logprobs kept if wanted)."""
        done, t0 = 0, time.perf_counter()
        outputs = registry.member(run.engine, "LLMEngine.step", version=self.version)()
        run.clock["driver_step_s"] += time.perf_counter() - t0
        for out in outputs:
            if registry.member(out, "RequestOutput.finished"):
                self._check_expansion(run, out)
                ids = registry.member(out, "RequestOutput.prompt_token_ids")
                done += len(ids or ())
                if run.wanted and (tag := registry.member(out, "RequestOutput.request_id")) in run.wanted:
                    self.logprobs[run.wanted[tag]] = prompt_logprobs(out, list(ids))
        return done

    def drain_engine(self, run: ShardRun) -> None:
        """Step the engine until every request ended; every row of the shard must have been added."""
        while self._unfinished(run):
            run.in_flight -= self.step(run)
        if run.submitted != len(run.spec.rows):
            raise CaptureError(f"the shard has {len(run.spec.rows)} rows, {run.submitted} were read from its batches")

    def finish_shard(self, llm: Any, run: ShardRun) -> message.WorkerReply:
        """Once the worker holds every row: its sink seals the layer files."""
        t0 = time.perf_counter()
        self.wait_for_rows(llm, run)
        t1 = time.perf_counter()
        reply = message.call(llm, "e3p_finish_shard", version=self.version)
        run.clock["drain_s"], run.clock["finish_s"] = t1 - t0, time.perf_counter() - t1
        return reply

    def abort_shard(self, llm: Any, run: ShardRun) -> None:
        """Drop the shard's requests and the worker's temp files; best effort, the first error is the one raised."""
        with contextlib.suppress(Exception):
            abort_request = registry.member(run.engine, "LLMEngine.abort_request", version=self.version)
            abort_request([run.spec.tag(i) for i in range(run.submitted)] + run.probes)
        with contextlib.suppress(Exception):
            message.call(llm, "e3p_abort_shard", version=self.version)

    def entries(self, reply: message.WorkerReply, run: ShardRun) -> dict[int, dict[str, Any]]:
        """The worker's layer-file entries, or its error as one line; the shard's timings kept in `stats`."""
        if reply.error is not None:
            text = f"the worker could not write the shard's layer files: {reply.error}"
            if reply.user_error:  # e.g. the disk filled up: one line for the user, no traceback
                raise WorkerUserError(text)
            raise CaptureError(text)
        self.stats = {
            "window_tokens": self.window_tokens,
            **({"logprob_notes": self.logprob_notes} if self.logprob_notes else {}),
            **{k: round(v, 3) for k, v in run.clock.items()},
            "image_threads_s": round(sum(run.made_s), 3),
            **(reply.stats or {}),
        }
        return reply.layer_entries()

    def _unfinished(self, run: ShardRun) -> bool:
        return registry.member(run.engine, "LLMEngine.has_unfinished_requests", version=self.version)()

    def _params(self, run: ShardRun, index: int, ids: list[int]) -> tuple[str, Any, Probe | None]:
        """The tag and sampling params of the shard's row `index`, and its logits check's prefix request if any
        (`run.wanted` then maps the prefix request's tag to the row)."""
        tag = run.spec.tag(index)
        if tag not in run.wanted:
            return tag, sampling_params(tag), None
        params, probe, note = logprob_request(tag, ids)
        if note:
            self.logprob_notes.append(note)
            log(note)
        if probe is not None or note:  # the row's own request returns no logprobs
            row = run.wanted.pop(tag)
            if probe is not None:
                run.wanted[probe.tag] = row
        return tag, params, probe

    def _prefetched(
        self,
        batches: Iterator[list[list[int]]],
        engine: Any,
        params_of: Callable[[int, list[int]], tuple[str, Any, Probe | None]],
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
                pool = images.RequestPool(images.request_maker(engine, self.version), self.model_path)
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

    def _prompt(self, run: ShardRun, row: Row) -> Any:
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

    def _check_expansion(self, run: ShardRun, out: Any) -> None:
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
