"""The driver's half of a shard, the same on both capture paths (DESIGN.md §5): open the worker's sink, stream the
rows' requests in (no batch barrier), step the engine until every request ended, wait for the worker to hold every
row, and ask it to finish the shard. Each path (hooks/path.py, builtin/path.py) adds its engine kwargs, its install
call and its wait for the rows.

One function a phase: open_shard, submit_rows (with add_row and step), drain_engine, finish_shard; abort_shard when
any of them fails. What they count is one feed.ShardRun; each row's request is made by feed.py.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import TYPE_CHECKING, Any

from ...errors import UserError
from .. import registry
from ..engine.errors import EngineError
from . import feed, message
from .feed import Row, ShardRun
from .requests import CaptureError, prompt_logprobs

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ...shard.sink import SinkSpec


class WorkerUserError(UserError):
    """A UserError raised in the vLLM worker (a full disk), passed on with its message."""


class WorkerError(CaptureError):
    """Any other error of the worker's capture (out of GPU memory, say), passed on with its message; the worker
    printed its traceback into the job's log. Also rows that never reached the worker's sink (no traceback)."""


class WorkerFailure(EngineError, CaptureError):
    """A WorkerError as the job's one line (engine/errors.worker_failed); still a CaptureError, so that the probe's
    smoke capture adds its own fix to it."""


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
        self.logprobs = {}
        return run

    def submit_rows(self, run: ShardRun, batches: Iterator[list[list[int]]]) -> None:
        """Every row's request added, the engine stepped whenever more than the window is in flight."""
        params_of = functools.partial(feed.row_params, run)
        rows = feed.prefetched(batches, run.engine, params_of, self.version, self.model_path)
        with contextlib.closing(rows):  # closed: threads end here
            for row in rows:
                self.add_row(run, row)
                # The last step's rows reach the files after its forward, where nothing overlaps them: the
                # shard's last step_tokens go in a few rows at a time, so that step (and the tail) is small.
                window, tail = run.window(self.window_tokens)
                while (row.batch_end or tail) and run.in_flight > window and self._unfinished(run):
                    run.in_flight -= self.step(run)

    def add_row(self, run: ShardRun, row: Row) -> None:
        """One row's request added to the engine, and its logits check's prefix request after it."""
        prompt = feed.prompt(run, row)
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
                feed.check_expansion(run, out)
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
            raise WorkerError(text)
        self.stats = {
            "window_tokens": self.window_tokens,
            **({"logprob_notes": run.logprob_notes} if run.logprob_notes else {}),
            **{k: round(v, 3) for k, v in run.clock.items()},
            "image_threads_s": round(sum(run.made_s), 3),
            **(reply.stats or {}),
        }
        return reply.layer_entries()

    def _unfinished(self, run: ShardRun) -> bool:
        return registry.member(run.engine, "LLMEngine.has_unfinished_requests", version=self.version)()
