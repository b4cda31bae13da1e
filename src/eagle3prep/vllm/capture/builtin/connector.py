"""Worker side of the built-in path (DESIGN.md §5): vLLM's `extract_hidden_states` keeps the requested
layers in a KV-cache-like buffer; this connector, loaded by the public `kv_connector_module_path`,
gathers each finished request's rows from that buffer on the device and hands them to the open
shard's LayerSink, in the worker. No per-request file, no hidden-state byte in the driver.

It subclasses vLLM's ExampleHiddenStatesConnector (0.18+) for its scheduler half (which requests
finished, their blocks held until we report them sent) and replaces its per-request file writes.
A prompt prefilled over several steps is handed out as it goes (`PartSave`): each step also gathers what
its running requests computed before it, so a shard's tail after its last forward is one step's rows,
not its longest request's (a 64k-token row is 2 GB on the 8B shape).
What it relies on of vLLM's internals is listed in INTERNALS and checked when the class is built:
a changed vLLM stops the probe with one line, not a wrong shard.

vLLM is imported lazily, so this module imports without it (the base environment's tests).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import TYPE_CHECKING, Any

from ... import names, registry
from ..requests import request_tag
from ..worker import PORT, Done
from .prefill_parts import PartSave, PrefillParts

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

    from ....shard.sink import LayerSink

CONNECTOR = "E3PHiddenStatesConnector"  # vLLM loads it as `kv_connector` from this module (kv_connector_module_path)
VLLM_MODULE = names.EXAMPLE_CONNECTOR
SCHED_MODULE = names.SCHEDULER_OUTPUT  # what build_connector_meta reads of a step (PartSave)
# What of vLLM's example connector module this one uses: its entries in vllm/names.py (the built-in
# path's), checked by check_internals(): {"module": top-level names, class: its methods and fields}.
_ENTRIES = [n for n in names.NAMES if n.module == VLLM_MODULE and n.needed_by == names.BUILTIN]
_PARENT = registry.entry("ExampleHiddenStatesConnector").path
# Set by the parent's __init__; checked right after it, so a changed vLLM fails the engine start.
INSTANCE_INTERNALS = tuple(
    n.path.split(".")[1] for n in _ENTRIES if n.kind == "member" and n.path.startswith(f"{_PARENT}.")
)
INTERNALS: dict[str, tuple[str, ...]] = {"module": tuple(n.path for n in _ENTRIES if n.kind == "object")}
for _cls, _, _attr in (n.path.partition(".") for n in _ENTRIES if n.kind in ("method", "member")):
    if not (_cls == _PARENT and _attr in INSTANCE_INTERNALS):
        INTERNALS[_cls] = (*INTERNALS.get(_cls, ()), _attr)
SCHED_INTERNALS: dict[str, tuple[str, ...]] = {}
for _name in names.NAMES:
    if _name.module == SCHED_MODULE and _name.needed_by == names.BUILTIN and _name.kind == "member":
        _cls, _, _attr = _name.path.partition(".")
        SCHED_INTERNALS[_cls] = (*SCHED_INTERNALS.get(_cls, ()), _attr)


def _fields(obj: Any) -> set[str]:
    import dataclasses

    names = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
    return names | set(dir(obj))


def check_internals(module: Any, sched: Any = None) -> str | None:
    """None if `module` (vLLM's example connector module) has all INTERNALS and `sched` (vLLM's scheduler
    output module, when given) all SCHED_INTERNALS; else one line naming what's gone."""
    missing = [n for n in INTERNALS["module"] if not hasattr(module, n)]
    for mod, table in ((module, INTERNALS), (sched, SCHED_INTERNALS if sched is not None else {})):
        for cls, fields in table.items():
            if cls != "module" and hasattr(mod, cls):
                have = _fields(getattr(mod, cls))
                missing += [f"{cls}.{n}" for n in fields if n not in have]
            elif cls != "module":  # the class itself is gone: named by its first entry
                missing.append(f"{cls}.{fields[0]}")
    if not missing:
        return None
    first = registry.missing_line(missing[0])
    return first if len(missing) == 1 else f"{first} (and {', '.join(missing[1:])})"


def slots_of(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """The cache slots of a request's first `num_tokens` tokens, in token order."""
    import torch

    blocks = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()[:num_tokens]


def steps_of(
    spans: list[tuple[str, int, int, int]], cap: int
) -> list[tuple[int, int, list[tuple[str, int, int, int]]]]:
    """Rows [0, total) of request pieces laid end to end, `spans` (tag, first position in its row, start, end),
    cut into steps of at most `cap` rows: (a, b, [(tag, first_pos, start, end) relative to a])."""
    total = spans[-1][3] if spans else 0
    out = []
    for a in range(0, total, cap):
        b = min(a + cap, total)
        segs = [(t, p + max(a, s) - s, max(a, s) - a, min(b, e) - a) for t, p, s, e in spans if s < b and e > a]
        out.append((a, b, segs))
    return out


@functools.cache
def _connector_class() -> type:
    return build_connector(registry.load(VLLM_MODULE), registry.load(SCHED_MODULE))


def build_connector(module: Any, sched: Any = None) -> type:
    """Our connector on top of `module`'s ExampleHiddenStatesConnector (vLLM's, or a test's fake); `sched` is
    vLLM's scheduler output module, checked for what build_connector_meta reads."""
    problem = check_internals(module, sched)
    if problem:
        raise registry.VLLMInternalError(problem)

    class E3PHiddenStatesConnector(getattr(module, _PARENT)):
        """ExampleHiddenStatesConnector whose finished requests go to the shard's LayerSink."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            missing = [n for n in INSTANCE_INTERNALS if not hasattr(self, n)]
            if missing:
                raise registry.missing(f"{_PARENT}.{missing[0]}", self)
            self._e3p_ready: Any = None  # this step's start on the device (bind_connector_metadata)
            self._e3p_gathered: Any = None  # the last step's gather (its parts' blocks are not held for it)
            self._e3p_prefills = PrefillParts()  # scheduler side: rows being prefilled, what went out of them

        # ---- scheduler side: the request's tag travels with its pending save; prefills hand out parts ----
        def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
            req_id = registry.member(request, "Request.request_id")
            handed = self._e3p_prefills.finished(req_id)
            if req_id not in self._request_filenames:
                return False, None  # aborted before it was scheduled: nothing to save (0.26's parent raises)
            delay, kv_params = super().request_finished(request, block_ids)
            pending = self._pending_saves.get(req_id)
            if pending is not None:
                pending.e3p_tag = request_tag(registry.member(request, "Request.sampling_params"), req_id)
                pending.e3p_from = handed
            return delay, kv_params

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            meta = super().build_connector_meta(scheduler_output)
            meta.e3p_parts = self._e3p_prefills.step(scheduler_output, self._cache_kv_group_id, self._block_size)
            return meta

        # ---- worker side: one gather per step's finished requests, into the sink ----
        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            # vLLM binds a step's metadata before it launches the step's forward: every earlier step's
            # work, the proposer's writes to the hidden-states cache included, is queued by then.
            super().bind_connector_metadata(connector_metadata)
            PORT.steps += 1
            _wait_for(self._e3p_gathered)  # a preempted request's blocks may be reused by this forward
            self._e3p_gathered = None
            self._e3p_ready = _step_start(self._kv_cache)

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            if self.has_connector_metadata():
                meta = self._get_connector_metadata()
                pending = registry.member(meta, "ExampleHiddenStatesConnectorMetadata.pending_saves")
                saves, meta.pending_saves = list(pending or []), []
                parts, meta.e3p_parts = list(getattr(meta, "e3p_parts", None) or []), []
                ready, self._e3p_ready = self._e3p_ready, None
                if (saves or parts) and self._is_tp_rank_zero:
                    gathered = self._e3p_write(saves + parts, ready)
                    self._e3p_gathered = gathered if parts else None  # finished saves' blocks are held for it
                    for p in saves:  # reported sent by the parent's get_finished once the gather ran
                        self._req_copy_events[p.req_id] = gathered
            return super().get_finished(finished_req_ids)

        def _e3p_write(self, saves: list[Any], ready: Any) -> Any:
            """The saves' and parts' rows into the open sink; an event that completes when their blocks may
            be reused."""
            sink = PORT.sink
            if sink is None:
                return Done()  # no shard open: aborted requests of a failed shard
            try:
                mine = [p for p in saves if getattr(p, "e3p_tag", None) in sink.rows]
                PORT.part_tokens += sum(p.end - p.start for p in mine if isinstance(p, PartSave))
                return self._e3p_gather_into(sink, mine, ready)
            except Exception as e:  # a raise here would kill the engine: finish() reports it
                sink._fail(e)
                return Done()

        def _e3p_gather_into(self, sink: LayerSink, saves: list[Any], ready: Any) -> Any:
            if not saves:
                return Done()
            spans, slots, at = _saved_spans(sink, saves, self._block_size)
            if not at:  # finished requests whose every row went out in parts (async scheduling ran them once more)
                return Done()
            with _beside_the_forward(sink, self._kv_cache, ready):
                hs, gathered = _gather(module, self._kv_cache, slots, at, len(sink.layer_ids))
                _into_sink(sink, hs, spans)
            return gathered

    E3PHiddenStatesConnector.__qualname__ = CONNECTOR
    E3PHiddenStatesConnector.__module__ = __name__
    return E3PHiddenStatesConnector


def _saved_spans(
    sink: LayerSink, saves: list[Any], block_size: int
) -> tuple[list[tuple[Any, int, int, int]], list[Any], int]:
    """Each save's or part's (tag, first position in its row, start, end) in the gathered buffer, its
    KV-cache slots, and the buffer's length; a save whose token count is not its row's stops the shard."""
    spans, slots, at = [], [], 0
    for p in saves:
        length = sink.rows[p.e3p_tag][1]
        if isinstance(p, PartSave):
            first, end = p.start, p.end
            if end > length:
                raise RuntimeError(f"request {p.e3p_tag}: vLLM computed {end} tokens, the row has {length}")
        else:
            first, end = getattr(p, "e3p_from", 0), int(p.token_ids.shape[0])
            if end != length:
                raise RuntimeError(f"request {p.e3p_tag}: vLLM saved {end} tokens, the row has {length}")
        if end <= first:
            continue
        spans.append((p.e3p_tag, first, at, at + end - first))
        slots.append(slots_of(p.block_ids, block_size, end)[first:])
        at += end - first
    return spans, slots, at


def _wait_for(event: Any) -> None:
    """Make the compute stream wait for a CUDA event (the last gather); nothing on a CPU."""
    if event is not None and not isinstance(event, Done):
        import torch

        torch.cuda.current_stream().wait_event(event)


def _step_start(kv_cache: Any) -> Any:
    """A CUDA event at the current point of the compute stream (None on a CPU, or before the cache exists)."""
    if kv_cache is None or not kv_cache.is_cuda:
        return None
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


@contextlib.contextmanager
def _beside_the_forward(sink: LayerSink, kv_cache: Any, ready: Any) -> Iterator[None]:
    """Run the gather and its copies to the host on the sink's side stream, after `ready` (this step's start)
    rather than after this step's forward: the finished requests' rows were complete before it, so their
    slot fills while the forward runs, and the host never waits for the forward. Without `ready` (a step
    not bound first) it waits for everything queued so far, the forward included. On a CPU: inline."""
    if not kv_cache.is_cuda:
        yield
        return
    import torch

    side = sink.copy_stream(kv_cache.device)
    if ready is None:
        side.wait_stream(torch.cuda.current_stream(kv_cache.device))
    else:
        side.wait_event(ready)
    with torch.cuda.stream(side):
        yield


def _gather(module: Any, kv_cache: Any, slots: list[Any], at: int, n_layers: int) -> tuple[Any, Any]:
    """The saves' hidden states out of vLLM's cache, [at, L, H], and an event that completes when their
    blocks may be reused."""
    import torch

    mapping = torch.cat(slots)
    if kv_cache.is_cuda:  # from pageable memory the copy could wait for the queued forward
        mapping = mapping.pin_memory()
    mapping = mapping.to(kv_cache.device, non_blocking=True)
    hs = module.extract_from_kv_cache(kv_cache, mapping, at)  # [T, L, H], a fresh tensor
    if hs.dim() != 3 or hs.shape[1] != n_layers or hs.shape[0] != at:
        raise RuntimeError(
            f"vLLM's hidden-states cache gave {tuple(hs.shape)}, expected [{at}, {n_layers}, H] "
            "(did the buffer's layout change?)"
        )
    gathered: Any = Done()
    if hs.is_cuda:  # the blocks are free once the gather ran (on the current stream), whichever reuses them
        gathered = torch.cuda.Event()
        gathered.record()
    return hs, gathered


def _into_sink(sink: LayerSink, hs: Any, spans: list[tuple[Any, int, int, int]]) -> None:
    """The gathered [T, L, H] buffer into the sink, a step of at most step_tokens at a time."""
    from ....shard.sink import Segment

    for a, b, segs in steps_of(spans, sink.spec.step_tokens):
        sink.begin_step([Segment(*s) for s in segs])
        part = hs[a:b]
        for j, lid in enumerate(sink.layer_ids):  # layers in the buffer follow the ascending ids
            sink.add_layer(lid, part[:, j])
        PORT.tokens += b - a
    PORT.last_at = time.monotonic()


def __getattr__(name: str) -> Any:
    # vLLM resolves the connector with getattr(import_module(kv_connector_module_path), name).
    if name == CONNECTOR:
        return _connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
