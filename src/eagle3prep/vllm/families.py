"""Whether the installed vLLM has an EAGLE-3 interface for a model family, asked before any GPU job (DESIGN.md §5),
and the parse-time check of extract.capture_path that reads it (the choice itself is capture/choice.py's).

The built-in path asks vLLM for the target's aux hidden states, which vLLM gives only to a model class with
SupportsEagle3 (its EAGLE-3 interface): without it the engine start fails with "Model does not support EAGLE3
interface". The hooks need no interface, only vLLM's V1 model runner, gone since 0.34. A family without the
interface on a vLLM without the hooks has no path: refused in one line that names what can capture it.

The interface is asked of the installed vLLM's model registry (names in vllm/names.py). At parse time that
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

from ..errors import ConfigError
from ..model_facts import ModelFacts
from . import registry
from .capture.choice import refusal

# Parse runs on every `snakemake -n`: the same vLLM is not asked twice about the same architecture.
STAMP = ".snakemake/eagle3prep/eagle3-check.json"
ANSWER_PREFIX = "eagle3prep-eagle3: "  # vLLM logs to stdout too: the child's answer is the line with this prefix
CHILD_TIMEOUT_S = 300


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


def check_capture_path(backend: str, capture_path: str, model_path: str | os.PathLike) -> None:
    """extract.capture_path against the installed vLLM and the model's family, at parse time: a family no path of
    this vLLM takes (no SupportsEagle3 for the built-in path, no hooks from 0.34 on) is refused before any GPU job,
    in one line naming what can capture it (capture/choice.refusal). Where no vLLM is installed here, or vLLM
    cannot tell, the engine start decides."""
    if backend != "vllm" or not (Path(model_path) / "config.json").is_file():
        return
    archs = ModelFacts.read(model_path).architectures
    if not archs:
        return
    asked = installed_support(archs[0])
    if asked is None:
        return
    version, supports = asked
    if line := refusal(version, archs[0], capture_path, supports):
        raise ConfigError(f"config error: {line}")


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
