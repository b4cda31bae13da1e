"""What the config needs of the Python that runs the jobs, checked before any job starts (in -n too): an engine or
a library a setting selects (vLLM for extract.backend: vllm, ...) that this interpreter lacks is one line naming the
environment that has it (without the check, every GPU job died in its own traceback). Each need names the rules
whose jobs import it; the workflow asks once its DAG is built (rules/common.smk), for the jobs that will run, so a
target that starts none of them (a prompt shard, `--lint`, a finished run) is not refused.

Only module presence is looked up (importlib.util.find_spec: no import, no cost at parse time). With
--software-deployment-method conda each rule brings its own environment (envs/*.yaml), so nothing is checked.

A GPU the config selects for a job of the hf backend or validation's reference forward (`device: cuda`) is checked
too, by `cuda_error`: torch.cuda.is_available() in this Python. Only where those jobs run here: a non-local executor
(--executor slurm) runs them on other nodes, and its submit host may well have no GPU, so nothing is asked there.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from ..infra.mode import Mode
from ..settings import Settings

GPU_ENV = ".venv-gpu/bin/snakemake (make gpu-env builds it; docs/guides/install.md)"
DATASETS_ENV = (
    ".venv/bin/snakemake or .venv-gpu/bin/snakemake (envs/base.txt and envs/gpu.txt pin it), or pip install "
    "'eagle3prep[hfdatasets]'"
)


@dataclass(frozen=True, slots=True)
class Need:
    """A module the config needs when `wanted` holds, the setting that selects it, and where to find it."""

    module: str
    package: str  # as the user knows it
    setting: str  # the config key and value that select it
    wanted: Callable[[Settings, Sequence[str]], bool]  # (settings, data.sources expanded)
    rules: tuple[str, ...]  # the rules whose jobs import it
    where: str = GPU_ENV


NEEDS = (
    Need(
        "vllm",
        "vLLM",
        "extract.backend = vllm",
        lambda s, _: s.extract.content.backend == "vllm",
        ("extract",),
    ),
    Need("vllm", "vLLM", "regenerate.enabled = true", lambda s, _: s.regenerate.workflow.enabled, ("regenerate",)),
    Need("vllm", "vLLM", "validate.overfit_gate = true", lambda s, _: s.validate.overfit_gate, ("overfit_gate",)),
    # The gate trains in a child process, which may be another Python (EAGLE3PREP_TRAIN_PYTHON).
    Need(
        "speculators",
        "speculators",
        "validate.overfit_gate = true",
        lambda s, _: s.validate.overfit_gate and not os.environ.get("EAGLE3PREP_TRAIN_PYTHON"),
        ("overfit_gate",),
    ),
    # prepare reads a Hugging Face save_to_disk folder with datasets.load_from_disk (prepare.readers.HFDiskReader).
    Need(
        "datasets",
        "datasets",
        "a save_to_disk folder in data.sources",
        lambda _, sources: any(os.path.isdir(src) for src in sources),
        ("prepare", "prepare_prompt_only"),
        DATASETS_ENV,
    ),
    # The export writes speculators' Arrow dataset with datasets (export.speculators).
    Need(
        "datasets",
        "datasets",
        "export.speculators = true",
        lambda s, _: bool(s.export.speculators),
        ("export",),
        DATASETS_ENV,
    ),
)


def missing(settings: Settings, has: Callable[[str], bool] | None = None, source_paths: Sequence[str] = (),
            jobs: Collection[str] | None = None) -> list[Need]:  # fmt: skip
    """The needs of this config that the running Python lacks (one per module); `source_paths`: data.sources
    expanded; `jobs`: the rules of the jobs that will run (None: every rule)."""
    has = has or (lambda module: importlib.util.find_spec(module) is not None)
    out: dict[str, Need] = {}
    for need in NEEDS:
        if jobs is not None and not set(need.rules) & set(jobs):
            continue
        if need.module not in out and need.wanted(settings, source_paths) and not has(need.module):
            out[need.module] = need
    return list(out.values())


def check(settings: Settings, conda: bool = False, python: str = sys.executable,
          has: Callable[[str], bool] | None = None, source_paths: Sequence[str] = (),
          jobs: Collection[str] | None = None) -> str | None:  # fmt: skip
    """The one line that stops the run when the jobs it will run (`jobs`: their rules; None: every rule) need a
    module this Python lacks; None when it has all (or `conda`: the rules' own environments provide them)."""
    if conda:
        return None
    lacking = missing(settings, has, source_paths, jobs)
    if not lacking:
        return None
    first = lacking[0]
    others = "".join(f"; {n.setting} needs {n.package} too" for n in lacking[1:])
    return (
        f"config error: {first.setting} needs {first.package}, which this Python ({python}) does not have{others}; "
        f"run the workflow with the environment that has it: {first.where}, or pass --sdm conda"
    )


def cuda_settings(settings: Settings, jobs: Collection[str] | None = None) -> list[str]:
    """The settings that put a job of this config (of `jobs`' rules; None: every rule) on a CUDA device through this
    Python's torch (vLLM jobs find their platform themselves: the module check covers them)."""
    out = []
    ex = settings.extract.content
    if ex.backend == "hf" and ex.device == "cuda" and (jobs is None or "extract" in jobs):
        out.append("extract.device = cuda (extract.backend = hf)")
    v = settings.validate
    if v.reference_mode == "full" and v.device.startswith("cuda") and (jobs is None or "validate" in jobs):
        out.append(f"validate.device = {v.device}")
    return out


def cuda_error(settings: Settings, local_exec: bool, conda: bool = False, python: str = sys.executable,
               cuda_available: Callable[[], tuple[bool, str]] | None = None,
               jobs: Collection[str] | None = None) -> str | None:  # fmt: skip
    """One line when the config puts a job on CUDA and this Python's torch sees no GPU, where the jobs run on
    this host; None otherwise. Skipped (None) for a non-local executor (--executor slurm: the jobs run on GPU
    nodes, and a submit host without a GPU is normal) and under --sdm conda (each rule brings its own torch).
    `cuda_available`: () -> (available, what this torch is), for tests; torch is imported only when asked."""
    wants = cuda_settings(settings, jobs)
    if not wants or not local_exec or conda:
        return None
    available, torch_is = (cuda_available or _torch_cuda)()
    if available:
        return None
    return (
        f"config error: {' and '.join(wants)} runs on a GPU, but this Python ({python}) has {torch_is}; run the "
        f"workflow on a GPU host with the environment that has a CUDA torch: {GPU_ENV}, or set the device to cpu, "
        "or submit the jobs to GPU nodes (--executor slurm: docs/guides/cluster.md)"
    )


def _torch_cuda() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "no torch"
    if torch.cuda.is_available():
        return True, f"torch {torch.__version__}"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} built without CUDA"
    return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}), which sees no GPU"


class Guard:
    """The checks above, asked while Snakemake builds its DAG: `guard.input(rule, will_run)` is an input function
    (it adds no input) for a rule whose jobs need what NEEDS names. The first job of that rule that will run (its
    `will_run(wildcards)`: an output missing or unfinished, or healing redoes it) stops a run or dry run in one line
    when this Python lacks the module, or the CUDA device where the jobs run here; a finished job of the rule (a
    target that starts none, --summary, --lint) asks nothing. Only the main process asks: a spawned job's does not.
    A job re-queued for another reason (an upstream output made again) is not foreseen: it then stops in its log."""

    def __init__(self, settings: Settings, mode: Callable[[], Mode], main: bool, sdm_conda: bool = False,
                 source_paths: Sequence[str] = ()) -> None:  # fmt: skip
        # sdm_conda: --sdm conda, each rule brings its own environment (the Snakefile's parser reads a line that
        # opens with `conda` as its directive, hence the name)
        self.settings, self.mode, self.main, self.source_paths = settings, mode, main, source_paths
        self.conda = sdm_conda
        self.asked: set[str] = set()

    def input(self, rule: str, will_run: Callable[[object], bool]) -> Callable[[object], list[str]]:
        def guard(wildcards: object) -> list[str]:
            if self.main and rule not in self.asked and will_run(wildcards):
                self.asked.add(rule)
                if error := self.error(rule):
                    sys.exit(error)
            return []

        return guard

    def error(self, rule: str) -> str | None:
        mode = self.mode()
        if not mode.executor or mode.touch:
            return None
        return check(self.settings, conda=self.conda, source_paths=self.source_paths, jobs={rule}) or cuda_error(
            self.settings, local_exec=mode.local, conda=self.conda, jobs={rule}
        )
