"""The vLLM internals the hooks capture path reads, each named, each checked.

No public vLLM API says which rows of a forward step belong to which request, or where a model's
decoder layers are: the hooks read them from the V1 model runner and the model (compat.step_layout,
worker.HiddenStatesCapture). A vLLM release that renames one must stop the job in one line naming the
internal and the version, never switch a feature off or read other rows in silence: every read below
raises VLLMInternalError instead of falling back. Each is an entry of vllm_common/registry.py (its vLLM
range: the V1 runner's, gone in 0.34); tests/test_hooks_internals.py removes each one.
Nothing here imports vLLM.
"""

from __future__ import annotations

import inspect
from typing import Any

from ...vllm_common import registry
from ...vllm_common.registry import VLLMInternalError

__all__ = ["HOOKS_INTERNALS", "VLLMInternalError", "check_layer_input", "missing", "require"]

# Decoder layers are each model's own class: the registry checks the validated families' (LlamaModel.layers,
# LlamaDecoderLayer.forward, ...); the line names what the hooks look for on any model.
_PER_MODEL = {
    "layers": registry.Name(
        "decoder layers at model.model.layers (or get_language_model().model.layers)",
        "vllm.model_executor.models", "member", registry.HOOKS, "the decoder layers the hooks sit on",
    ),
    "layer_forward": registry.Name(
        "DecoderLayer.forward(positions, hidden_states, residual)", "vllm.model_executor.models", "method",
        registry.HOOKS, "layer id 0 reads its input",
    ),
}  # fmt: skip
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
    **{k: n.path for k, n in _PER_MODEL.items()},
}
INPUT_BATCH_FIELDS = ("req_ids", "num_reqs", "num_computed_tokens_cpu")  # read every forward step
FIX = "install the vLLM pinned in envs/gpu.txt, or set extract.capture_path: builtin"

vllm_version = registry.installed  # the version the lines name (cached: tests clear it)


def missing(name: str, owner: Any = None, fix: str | None = None) -> VLLMInternalError:
    """The one line for internal `name` (a HOOKS_INTERNALS key) missing on `owner`; the fix, unless given, is the
    registry's for the installed version (the built-in path, on a vLLM without the V1 runner)."""
    entry = _PER_MODEL.get(name) or registry.entry(HOOKS_INTERNALS[name])
    return registry.missing(entry, owner, fix or (None if entry.needed_by == registry.HOOKS else FIX))


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
