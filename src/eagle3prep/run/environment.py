"""What the config needs of the Python that runs the jobs, checked when the workflow is parsed: an engine or a
library a setting selects (vLLM for extract.backend: vllm, ...) that this interpreter lacks is one line naming the
environment that has it, before any job starts (without the check, every GPU job died in its own traceback).

Only module presence is looked up (importlib.util.find_spec: no import, no cost at parse time). With
--software-deployment-method conda each rule brings its own environment (envs/*.yaml), so nothing is checked.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..settings import Settings

GPU_ENV = ".venv-gpu/bin/snakemake (make gpu-env builds it; docs/guides/install.md)"


@dataclass(frozen=True, slots=True)
class Need:
    """A module the config needs when `wanted` holds, the setting that selects it, and where to find it."""

    module: str
    package: str  # as the user knows it
    setting: str  # the config key and value that select it
    wanted: Callable[[Settings], bool]
    where: str = GPU_ENV


NEEDS = (
    Need("vllm", "vLLM", "extract.backend = vllm", lambda s: s.extract.content.backend == "vllm"),
    Need("vllm", "vLLM", "regenerate.enabled = true", lambda s: s.regenerate.workflow.enabled),
    Need("vllm", "vLLM", "validate.overfit_gate = true", lambda s: s.validate.overfit_gate),
    # The gate trains in a child process, which may be another Python (EAGLE3PREP_TRAIN_PYTHON).
    Need(
        "speculators",
        "speculators",
        "validate.overfit_gate = true",
        lambda s: s.validate.overfit_gate and not os.environ.get("EAGLE3PREP_TRAIN_PYTHON"),
    ),
)


def missing(settings: Settings, has: Callable[[str], bool] | None = None) -> list[Need]:
    """The needs of this config that the running Python lacks (one per module)."""
    has = has or (lambda module: importlib.util.find_spec(module) is not None)
    out: dict[str, Need] = {}
    for need in NEEDS:
        if need.module not in out and need.wanted(settings) and not has(need.module):
            out[need.module] = need
    return list(out.values())


def check(settings: Settings, conda: bool = False, python: str = sys.executable,
          has: Callable[[str], bool] | None = None) -> str | None:  # fmt: skip
    """The one line that stops the parse when the config needs a module this Python lacks; None when it has all
    (or `conda`: the rules' own environments provide them)."""
    if conda:
        return None
    lacking = missing(settings, has)
    if not lacking:
        return None
    first = lacking[0]
    others = "".join(f"; {n.setting} needs {n.package} too" for n in lacking[1:])
    return (
        f"config error: {first.setting} needs {first.package}, which this Python ({python}) does not have{others}; "
        f"run the workflow with the environment that has it: {first.where}, or pass --sdm conda"
    )
