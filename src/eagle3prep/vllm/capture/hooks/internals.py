"""The vLLM internals the hooks capture path reads, each named, each checked.

No public vLLM API says which rows of a forward step belong to which request, or where a model's
decoder layers are: the hooks read them from the V1 model runner and the model (step_layout,
worker.HiddenStatesCapture). A vLLM release that renames one must stop the job in one line naming the
internal and the version, never switch a feature off or read other rows in silence: every read below
raises VLLMInternalError instead of falling back. Each is an entry of vllm/names.py (its vLLM
range: the V1 runner's, gone in 0.34); tests/test_hooks_internals.py removes each one.
Nothing here imports vLLM.
"""

from __future__ import annotations

import inspect
from typing import Any

from ....shard.sink import Segment
from ... import names, registry
from ...registry import VLLMInternalError
from ..requests import TAG_KEY

__all__ = ["HOOKS_INTERNALS", "VLLMInternalError", "check_layer_input", "missing", "require", "step_layout"]

# name the hooks code uses -> its registry entry (the label the one line names)
HOOKS_INTERNALS = {
    "model_runner": "Worker.model_runner",
    "model": "GPUModelRunner.model",
    "input_batch": "GPUModelRunner.input_batch",
    "req_ids": "InputBatch.req_ids",
    "num_reqs": "InputBatch.num_reqs",
    "num_computed_tokens_cpu": "InputBatch.num_computed_tokens_cpu",
    "query_start_loc": "GPUModelRunner.query_start_loc",
    "requests": "GPUModelRunner.requests",
    "sampling_params": "CachedRequestState.sampling_params",
    "extra_args": "SamplingParams.extra_args",
    # on any model, whichever class holds them (names.ANY_MODEL)
    "layers": "decoder layers at model.model.layers (or get_language_model().model.layers)",
    "layer_forward": "DecoderLayer.forward(positions, hidden_states, residual)",
}
INPUT_BATCH_FIELDS = ("req_ids", "num_reqs", "num_computed_tokens_cpu")  # read every forward step
FIX = "install the vLLM pinned in envs/gpu.txt, or set extract.capture_path: builtin"

vllm_version = registry.installed  # the version the lines name (cached: tests clear it)


def missing(name: str, owner: Any = None, fix: str | None = None) -> VLLMInternalError:
    """The one line for internal `name` (a HOOKS_INTERNALS key) missing on `owner`; the fix, unless given, is the
    registry's for the installed version (the built-in path, on a vLLM without the V1 runner)."""
    entry = registry.entry(HOOKS_INTERNALS[name])
    return registry.missing(entry, owner, fix or (None if entry.needed_by == names.HOOKS else FIX))


def require(owner: Any, name: str, fix: str | None = None) -> Any:
    """owner.<name>, or the one line when this vLLM has no such attribute (None is a value, not a miss)."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise missing(name, owner, fix) from None


def check_layer_input(layer: Any) -> None:
    """Layer id 0 is the input of decoder layer 0, read from forward(positions, hidden_states, residual)'s
    positional arguments (worker._layer_input): another order would capture the wrong tensor in silence."""
    try:
        params = inspect.signature(layer.forward).parameters.values()
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if names[:1] != ["positions"] or len(names) < 2 or names[2:3] not in ([], ["residual"]):
        raise missing("layer_forward", layer, f"its forward takes ({', '.join(names)}); " + FIX)


def _query_start_loc(runner: Any) -> Any:
    """Host copy of the step's cumulative token offsets, [num_reqs + 1]: `query_start_loc.np` (a CpuGpuBuffer),
    `query_start_loc_np` next to a device tensor before vLLM 0.10.2."""
    legacy = registry.optional_member(runner, "GPUModelRunner.query_start_loc_np")
    if legacy is not None:
        return legacy
    return registry.member(require(runner, "query_start_loc"), "CpuGpuBuffer.np")


def request_tag(runner: Any, req_id: str) -> str:
    """Our tag of a request inside the worker; vLLM's own id for a request sent without one (the sink then
    names it). A runner without the request's state, or a state without its params, stops in one line."""
    state = require(runner, "requests").get(req_id)
    if state is None:
        raise missing("requests", runner)
    params = require(state, "sampling_params")
    extra = (require(params, "extra_args") if params is not None else None) or {}
    return str(extra.get(TAG_KEY, req_id))


def step_layout(runner: Any) -> list[Segment]:
    """Which rows of the current forward belong to which request, read from the model runner.

    Valid during the forward (the runner has already ordered `input_batch` and filled
    query_start_loc for this step). Returns [] when no request is scheduled (warm-up, dummy runs).
    Each internal it reads is checked: a vLLM without one stops in one line.
    """
    batch = require(runner, "input_batch")
    if batch is None:  # vLLM's V2 model runner builds its batch per step
        raise missing("input_batch", runner)
    for name in INPUT_BATCH_FIELDS:
        if not hasattr(batch, name):
            raise missing(name, batch)
    num_reqs = int(batch.num_reqs)
    if num_reqs == 0:
        return []
    qsl = _query_start_loc(runner)
    computed = batch.num_computed_tokens_cpu  # tokens each request had before this step
    segments = []
    for i, req_id in enumerate(batch.req_ids[:num_reqs]):
        start, end = int(qsl[i]), int(qsl[i + 1])
        if end > start:
            segments.append(Segment(request_tag(runner, req_id), int(computed[i]), start, end))
    return segments
