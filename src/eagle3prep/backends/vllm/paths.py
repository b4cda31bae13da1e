"""The two ways vLLM hands hidden states over, each writing through a LayerSink (DESIGN.md §5).

- hooks: forward hooks in the worker extension (worker.py); TP rank 0's worker runs the sink, the
  driver streams the requests in and asks the worker to finish.
- builtin: vLLM's `extract_hidden_states` speculative method + our hidden-states KV connector
  (connector.py, loaded by kv_connector_module_path): TP rank 0's worker gathers each finished
  request's rows from vLLM's hidden-states cache into the same sink. No per-request file.

Both stream the requests in (no batch barrier) and ask the worker to finish the shard.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

from ...errors import UserError
from ...infra.log import get_logger
from ...shard.sink import PROBE_SUFFIX
from ...tokenization.row_inputs import ImageRow
from ...vllm_common import registry
from ...vllm_common.memory import LOGPROB_WINDOW
from . import compat, image_requests
from .connector import CONNECTOR

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from ...shard.sink import SinkSpec

EXT_MODULE = "eagle3prep.backends.vllm.worker"
CONNECTOR_MODULE = "eagle3prep.backends.vllm.connector"
DRAIN_S = 600  # a shard's last rows reach the worker a step after their request ends: seconds, not minutes
# A shard of TAIL_PARTS steps or more gets its last step_tokens at most step_tokens / TAIL_PARTS at a time
# (capture_shard): the tail after the last forward (write, sha256 and fsync of its rows) shrinks with that step.
TAIL_PARTS = 4


log = get_logger("vllm backend").info


class CaptureError(RuntimeError):
    """The engine returned hidden states that do not match the request (layers, shapes, tokens)."""


class WorkerUserError(UserError):
    """A UserError raised in the vLLM worker (a full disk), passed on with its message."""


def sampling_params(tag: str, extra: dict[str, Any] | None = None, logprobs: bool = False) -> Any:
    SamplingParams = registry.load("SamplingParams")  # noqa: N806 - a class

    # One output token: the prompt's forward is all we need. The tag lets the worker (hooks) and
    # the connector (builtin) attribute rows to requests whatever ids vLLM assigns internally.
    # prompt_logprobs=0: the logprob of each actual prompt token (validate's logits check).
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        extra_args={compat.TAG_KEY: tag, **(extra or {})},
        **({"prompt_logprobs": 0} if logprobs else {}),
    )


def prompt_logprobs(out: Any, ids: list[int]) -> Any:
    """[T-1] float32 logprobs of tokens 1.. of a finished request (vLLM's position 0 has none)."""
    import torch

    per_pos = out.prompt_logprobs or []
    if len(per_pos) != len(ids):
        raise CaptureError(f"request {out.request_id}: {len(per_pos)} prompt logprobs for {len(ids)} tokens")
    return torch.tensor([per_pos[t][ids[t]].logprob for t in range(1, len(ids))], dtype=torch.float32)


class _Probe(NamedTuple):
    """The prefix request of a logits-check row longer than LOGPROB_WINDOW: its first tokens, prompt logprobs on."""

    tag: str
    ids: list[int]
    params: Any


class _Row(NamedTuple):
    """A row as the submission loop takes it: for a row with images, `ready` is the future of its request."""

    tag: str
    params: Any
    ids: list[int]
    ready: Future | None
    batch_end: bool  # the last row of its batch: the loop may step the engine after it
    probe: _Probe | None = None  # its logits check's prefix request, added right after it


def logprob_request(tag: str, ids: list[int], window: int | None = None) -> tuple[Any, _Probe | None, str]:
    """How a logits-check row asks for its prompt logprobs without vLLM computing them over a whole long chunk
    at once (vllm_common/memory.py): (the row's own params, its prefix request or None, a note when the check
    covers only part of the row or none of it)."""
    window = window or LOGPROB_WINDOW  # read here: tests shrink the module's window
    if len(ids) <= window:
        return sampling_params(tag, logprobs=True), None, ""
    if isinstance(ids, ImageRow):  # a prefix could cut an image's placeholder tokens in two
        return sampling_params(tag), None, f"row {tag}: {len(ids)} tokens with images, over {window}: no logits check"
    probe = tag + PROBE_SUFFIX
    note = f"row {tag}: logits check on its first {window} of {len(ids)} tokens"
    return sampling_params(tag), _Probe(probe, list(ids[:window]), sampling_params(probe, logprobs=True)), note


class _WorkerSinkPath:
    """The driver's half of a path whose sink runs in TP rank 0's worker: stream requests in, finish."""

    name = ""

    def __init__(self, layer_ids: list[int], version: str, model_path: str = ""):
        self.layer_ids = layer_ids
        self.version = version
        self.model_path = model_path  # the target's folder: its image processor checks a row's images
        self._made_s: list[float] = []  # the pool's seconds making each request of the shard
        self._image_rows: dict[str, list[int]] = {}  # tag -> tokenized ids of a row with images, until it ends
        self.window_tokens = 0  # set by the driver once the engine's step size is known
        self.logprobs: dict[int, Any] = {}
        self.logprob_notes: list[str] = []  # logits-check rows covered in part or not at all (logprob_request)
        self.stats: dict[str, Any] = {}  # the worker's sink timings of the last shard
        self._clock: dict[str, float] = {"driver_step_s": 0.0}  # the driver thread's seconds of the shard

    def capture_shard(self, llm: Any, batches: Iterator[list[list[int]]], spec: SinkSpec) -> dict[int, dict[str, Any]]:
        """Rows are fed to the engine as a stream, at most `window_tokens` prompt tokens in flight,
        so the scheduler always has a full step and no batch boundary leaves the GPU idle; a long shard's last
        step_tokens at most step_tokens / TAIL_PARTS at a time."""
        t_open = time.perf_counter()
        compat.rpc_result(llm.collective_rpc("e3p_open_shard", args=(dataclasses.asdict(spec),)), version=self.version)
        open_s = time.perf_counter() - t_open
        TokensPrompt = registry.load("TokensPrompt")  # noqa: N806 - a class

        engine = llm.llm_engine
        in_flight = submitted = 0
        unsent = spec.total_tokens  # prompt tokens of the shard not added yet
        tail_window = max(1, spec.step_tokens // TAIL_PARTS)
        tapered = spec.total_tokens >= TAIL_PARTS * spec.step_tokens  # smaller steps for a quarter at most
        probes: list[str] = []
        finished = False
        # where the driver's thread went (with images it can set the pace): opening the worker's sink, waiting for
        # the image threads' requests, adding requests, in engine steps, then the shard's tail (drain: its last
        # rows reach the sink; finish: the sink seals the files); and the image threads' own seconds
        clock = self._clock = {"driver_wait_s": 0.0, "driver_add_s": 0.0, "driver_step_s": 0.0, "open_s": open_s}
        self._made_s = []
        self.logprobs, wanted = {}, {spec.tag(r): r for r in spec.logprob_rows}
        self.logprob_notes = []
        self._image_rows = {}
        params_of = functools.partial(self._params, spec, wanted)
        try:
            with contextlib.closing(self._prefetched(batches, engine, params_of)) as rows:  # closed: threads end here
                for row in rows:
                    prompt = self._prompt(row)
                    t0 = time.perf_counter()
                    engine.add_request(row.tag, prompt, row.params)
                    if row.probe is not None:
                        engine.add_request(
                            row.probe.tag, TokensPrompt(prompt_token_ids=row.probe.ids), row.probe.params
                        )
                        probes.append(row.probe.tag)
                        in_flight += len(row.probe.ids)
                    clock["driver_add_s"] += time.perf_counter() - t0
                    submitted += 1
                    in_flight += len(row.ids)
                    unsent -= len(row.ids)
                    # The last step's rows reach the files after its forward, where nothing overlaps them: the
                    # shard's last step_tokens go in a few rows at a time, so that step (and the tail) is small.
                    tail = tapered and unsent < spec.step_tokens
                    window = tail_window if tail else self.window_tokens
                    while (row.batch_end or tail) and in_flight > window and engine.has_unfinished_requests():
                        in_flight -= self._step(engine, wanted)
            while engine.has_unfinished_requests():
                in_flight -= self._step(engine, wanted)
            if submitted != len(spec.rows):
                raise CaptureError(f"the shard has {len(spec.rows)} rows, {submitted} were read from its batches")
            t0 = time.perf_counter()
            self._drain(llm, spec)
            t1 = time.perf_counter()
            reply = compat.rpc_result(llm.collective_rpc("e3p_finish_shard"), version=self.version)
            clock["drain_s"], clock["finish_s"] = t1 - t0, time.perf_counter() - t1
            finished = True
        finally:
            if not finished:  # interrupted or failed: drop the requests and the worker's temp files
                with contextlib.suppress(Exception):
                    engine.abort_request([spec.tag(i) for i in range(submitted)] + probes)
                with contextlib.suppress(Exception):
                    llm.collective_rpc("e3p_abort_shard")
        if "error" in reply:
            message = f"the worker could not write the shard's layer files: {reply['error']}"
            if reply.get("user_error"):  # e.g. the disk filled up: one line for the user, no traceback
                raise WorkerUserError(message)
            raise CaptureError(message)
        self.stats = {
            "window_tokens": self.window_tokens,
            **({"logprob_notes": self.logprob_notes} if self.logprob_notes else {}),
            **{k: round(v, 3) for k, v in clock.items()},
            "image_threads_s": round(sum(self._made_s), 3),
            **reply.get("stats", {}),
        }
        return {int(k): v for k, v in reply["entries"].items()}

    def _params(
        self, spec: SinkSpec, wanted: dict[str, int], index: int, ids: list[int]
    ) -> tuple[str, Any, _Probe | None]:
        """The tag and sampling params of the shard's row `index`, and its logits check's prefix request if any
        (`wanted` then maps the prefix request's tag to the row)."""
        tag = spec.tag(index)
        if tag not in wanted:
            return tag, sampling_params(tag), None
        params, probe, note = logprob_request(tag, ids)
        if note:
            self.logprob_notes.append(note)
            log(note)
        if probe is not None or note:  # the row's own request returns no logprobs
            row = wanted.pop(tag)
            if probe is not None:
                wanted[probe.tag] = row
        return tag, params, probe

    def _prefetched(
        self,
        batches: Iterator[list[list[int]]],
        engine: Any,
        params_of: Callable[[int, list[int]], tuple[str, Any, _Probe | None]],
    ) -> Iterator[_Row]:
        """Each row in order, with its tag and params and whether it ends its batch. A row with images is made
        ready on a pool (image_requests.RequestPool), at most AHEAD_ROWS rows ahead of the one handed out: its
        images loaded and its request made by vLLM's input processor (compat.request_maker), so the driver's
        thread only adds it. The pool is made on the first row with images (a text-only shard starts none) and
        closed when the generator ends or is closed."""
        import torch

        pool: image_requests.RequestPool | None = None
        # vLLM's processor sets torch's (process-wide) thread count around each call and puts it back: calls on
        # several threads at once can leave another count behind, so the pool's end puts the first one back
        torch_threads = 0
        ahead: collections.deque[_Row] = collections.deque()

        def ready(ids: list[int], tag: str, params: Any) -> Future | None:
            nonlocal pool, torch_threads
            if not isinstance(ids, ImageRow):
                return None
            if pool is None:
                torch_threads = torch.get_num_threads()
                pool = image_requests.RequestPool(compat.request_maker(engine, self.version), self.model_path)
            return pool.submit(ids, tag, params)

        done = False
        try:
            index = 0
            for batch in batches:
                for k, ids in enumerate(batch):
                    tag, params, probe = params_of(index, ids)
                    ahead.append(_Row(tag, params, ids, ready(ids, tag, params), k == len(batch) - 1, probe))
                    index += 1
                    if len(ahead) > image_requests.AHEAD_ROWS:
                        yield ahead.popleft()
            while ahead:
                yield ahead.popleft()
            done = True
        finally:
            if pool is not None:
                pool.close(abandon=not done)  # closed early (a failure): nothing more is waited for
                torch.set_num_threads(torch_threads)

    def _prompt(self, row: _Row) -> Any:
        """What add_request is given: a text row's token ids, or the request the pool made of a row with images
        (image_requests.make_request; the row's ids kept to check what vLLM expanded when it ends)."""
        TokensPrompt = registry.load("TokensPrompt")  # noqa: N806 - a class

        if row.ready is None:
            return TokensPrompt(prompt_token_ids=list(row.ids))
        self._image_rows[row.tag] = list(row.ids)
        t0 = time.perf_counter()
        try:
            request, made_s = row.ready.result(timeout=image_requests.WAIT_S)
        except TimeoutError:
            raise CaptureError(
                f"request {row.tag}: no image worker made it in {image_requests.WAIT_S:.0f} s (a worker is stuck)"
            ) from None
        self._clock["driver_wait_s"] += time.perf_counter() - t0
        self._made_s.append(made_s)
        return request

    def _check_expansion(self, out: Any) -> None:
        """A row with images must reach the model as tokenize wrote it: vLLM's processor may not re-expand it."""
        if not self._image_rows:  # a text-only shard: nothing to compare
            return
        want = self._image_rows.pop(out.request_id, None)
        got = list(out.prompt_token_ids or ())
        if want is not None and got != want:
            raise CaptureError(
                f"request {out.request_id}: vLLM's processor made {len(got)} prompt tokens of the row's {len(want)} "
                "(its images expanded differently than tokenize expanded them): re-run tokenize with this model.path"
            )

    def _drain(self, llm: Any, spec: SinkSpec) -> None:
        """Wait until the worker holds every row (the hooks have them when the last request ends)."""

    def _step(self, engine: Any, wanted: dict[str, int]) -> int:
        """One engine step; the prompt tokens of the requests it finished (their logprobs kept if wanted)."""
        done, t0 = 0, time.perf_counter()
        outputs = engine.step()
        self._clock["driver_step_s"] += time.perf_counter() - t0
        for out in outputs:
            if out.finished:
                self._check_expansion(out)
                done += len(out.prompt_token_ids or ())
                if wanted and out.request_id in wanted:
                    self.logprobs[wanted[out.request_id]] = prompt_logprobs(out, list(out.prompt_token_ids))
        return done


class BuiltinPath(_WorkerSinkPath):
    """extract_hidden_states + our connector: TP rank 0's worker writes the layer files."""

    name = "builtin"

    def engine_kwargs(self) -> dict[str, Any]:
        # No lock files: nothing outside the worker waits for a request's rows. Compiled graphs are fine:
        # vLLM's own extract_hidden_states model writes the buffer, no module hook is involved.
        extra = {"use_synchronization_lock": False}
        return {
            "speculative_config": {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(self.layer_ids)}},
            },
            "kv_transfer_config": {
                "kv_connector": CONNECTOR,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": extra,
            },
            "worker_extension_cls": f"{EXT_MODULE}.HiddenStatesCapture",
        }

    def install(self, llm: Any) -> None:
        reply = compat.rpc_result(llm.collective_rpc("e3p_attach"), version=self.version)
        log(f"hidden-states connector attached on rank {reply['rank']}")

    def _drain(self, llm: Any, spec: SinkSpec) -> None:
        """A finished request's rows reach the connector one engine step after the driver sees it end.
        A multiprocess engine steps on its own until they are sent; an in-process one is stepped here."""
        engine, total = llm.llm_engine, spec.total_tokens
        inproc = compat.engine_in_process(engine)
        start, first = time.monotonic(), None
        deadline = start + DRAIN_S
        while True:
            reply = compat.rpc_result(llm.collective_rpc("e3p_shard_progress"), version=self.version)
            first, got = first or reply, reply["tokens"]
            if got >= total:
                # where the drain went: the connector's steps meanwhile, and how long after it began the last rows
                # reached the sink (the rest of drain_s is this loop's polling)
                self._clock["drain_steps"] = reply.get("steps", 0) - first.get("steps", 0)
                self._clock["drain_lag_s"] = max(0.0, reply.get("last_at", 0.0) - start)
                return
            if time.monotonic() > deadline:
                raise CaptureError(f"{got} of the shard's {total} rows reached the worker's sink in {DRAIN_S} s")
            if inproc:
                engine.step()
            else:
                time.sleep(0.002)


class HooksPath(_WorkerSinkPath):
    """Forward hooks in the worker extension; TP rank 0's worker writes the layer files."""

    name = "hooks"

    def engine_kwargs(self) -> dict[str, Any]:
        # Hooks need eager mode: compiled graphs (torch.compile, CUDA graphs) bypass module hooks.
        return {"worker_extension_cls": f"{EXT_MODULE}.HiddenStatesCapture", "enforce_eager": True}

    def install(self, llm: Any) -> None:
        reply = compat.rpc_result(
            llm.collective_rpc("e3p_install_hooks", args=(self.layer_ids,)), version=self.version
        )
        log(f"hooks installed on rank 0: {reply}")
