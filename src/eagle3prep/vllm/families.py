"""Which capture path of the installed vLLM takes a model family, decided before any GPU job (DESIGN.md §5).

The built-in path asks vLLM for the target's aux hidden states, which vLLM gives only to a model class with
SupportsEagle3 (its EAGLE-3 interface): without it the engine start fails with "Model does not support EAGLE3
interface". The hooks need no interface, only vLLM's V1 model runner, gone since 0.34. A family without the
interface on a vLLM without the hooks has no path: refused in one line that names what can capture it.

The interface is asked of the installed vLLM's model registry (names in vllm/registry.py). At parse time that
runs in a child process, since importing vLLM's model classes costs seconds and torch's memory, and its answer is
kept in a stamp per vLLM version and architecture.
Usage: python -m eagle3prep.vllm.families ARCH  (prints ANSWER_PREFIX and the answer as JSON)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from . import names, registry

# Parse runs on every `snakemake -n`: the same vLLM is not asked twice about the same architecture.
STAMP = ".snakemake/eagle3prep/eagle3-check.json"
ANSWER_PREFIX = "eagle3prep-eagle3: "  # vLLM logs to stdout too: the child's answer is the line with this prefix
CHILD_TIMEOUT_S = 300


def hooks_gone(version: str) -> bool:
    """vLLM `version` lacks what the hooks path reads (its V1 model runner, from 0.34 on); False when unknown."""
    try:
        return bool(registry.blocked(names.HOOKS, version))
    except ValueError:  # no version to read ("(unknown)")
        return False


def supports_eagle3(arch: str) -> bool | None:
    """Whether the installed vLLM's model class for `arch` implements SupportsEagle3; None when vLLM cannot tell
    (not installed, no class of its own for `arch`, or a registry API that moved: the engine start decides)."""
    try:
        model_registry = registry.load("ModelRegistry")
        has_interface = registry.load("supports_eagle3")
        cls = registry.member(model_registry, "_ModelRegistry._try_load_model_cls")(arch)
    except Exception:  # importing a model module can fail in many ways; none of them is this check's to report
        return None
    return None if cls is None else bool(has_interface(cls))


def builtin_blocker(version: str, arch: str, supports: bool | None) -> str | None:
    """Why the built-in path cannot take `arch` on vLLM `version`, as far as its interface decides; None: it can."""
    if supports is False:
        return (
            f"vLLM {version} has no SupportsEagle3 (its EAGLE-3 interface) for {arch}, which the built-in path needs"
        )
    return None


def other_ways(version: str, arch: str) -> str:
    """What can capture `arch` where vLLM `version`'s built-in path cannot: a vLLM and path that do, or hf."""
    ways = []
    since = names.EAGLE3_CLASSES.get(arch, ("", None))[1]
    if since and _newer(since, version):
        ways.append(f"vLLM {since} or later (the built-in path)")
    if hooks_gone(version):
        ways.append(f"a vLLM from {names.OLDEST} to before {names.V1_RUNNER_GONE} with extract.capture_path: hooks")
    else:
        ways.append("extract.capture_path: hooks (or auto)")
    ways.append("extract.backend: hf")
    return ", ".join(ways[:-1]) + " or " + ways[-1]


def _newer(a: str, b: str) -> bool:
    try:
        return names.parse_version(a) > names.parse_version(b)
    except ValueError:
        return False


def refusal(version: str, arch: str, wanted: str, supports: bool | None) -> str | None:
    """The one line refusing extract.capture_path `wanted` (auto | builtin | hooks) for `arch` on vLLM `version`:
    why, and what can capture it (never a path this vLLM refuses). None: a path of this vLLM takes it."""
    gone = hooks_gone(version)
    if wanted == "hooks" and gone:  # the registry's line names what the hooks read; its fix names the built-in path
        fix = None if supports is not False else f"use {other_ways(version, arch)}"
        return "extract.capture_path = hooks: " + registry.missing_line(
            registry.blocked(names.HOOKS, version)[0], version=version, fix_text=fix
        )
    blocker = builtin_blocker(version, arch, supports)
    if blocker is None:
        return None
    if wanted == "builtin":
        return f"extract.capture_path = builtin: {blocker}; use {other_ways(version, arch)}"
    if gone:
        return (
            f"extract.backend = vllm: no capture path of vLLM {version} takes {arch}: {blocker}, and its hooks path "
            f"is gone (no V1 model runner since {names.V1_RUNNER_GONE}); use {other_ways(version, arch)}"
        )
    return None  # auto takes the hooks


def installed_support(arch: str, stamp: str | os.PathLike | None = STAMP) -> tuple[str, bool | None] | None:
    """(the installed vLLM's version, supports_eagle3(arch)) asked in a child process and kept in `stamp`; None
    where no vLLM is installed (the jobs may run in another environment: their engine start decides)."""
    try:
        version = registry.installed_version()
    except Exception:  # no vLLM here
        return None
    key = f"{version} {arch}"
    known = _read_stamp(stamp)
    if key in known:
        return version, known[key]
    answer = _ask_child(arch)
    if answer is not None and stamp is not None:  # a child that failed is asked again next time
        from ..infra.atomic import atomic_open

        Path(stamp).parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(stamp, "w", encoding="utf-8") as f:
            json.dump({**known, key: answer["supports"]}, f)
    return version, (answer or {}).get("supports")


def _read_stamp(stamp: str | os.PathLike | None) -> dict[str, bool | None]:
    try:
        return json.loads(Path(stamp).read_text(encoding="utf-8")) if stamp else {}
    except (OSError, ValueError):
        return {}


def _ask_child(arch: str) -> dict | None:
    cmd = [sys.executable, "-m", __name__, arch]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(ANSWER_PREFIX)]
    return json.loads(lines[-1][len(ANSWER_PREFIX) :]) if done.returncode == 0 and lines else None


def main(argv: list[str]) -> int:
    print(ANSWER_PREFIX + json.dumps({"supports": supports_eagle3(argv[0])}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
