"""vLLM for the gate: greedy replies of the target alone, then the same prompts served with the draft.

Both engines are the regenerate stage's (regenerate.engine.VLLMEngine: the run's regenerate.* engine
settings, its one-line start errors and known-bug workarounds); the second adds speculative_config
(method eagle3) and turns vLLM's stats on, whose spec-decode counters `LLM.get_metrics()` returns.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Any

from ..model_facts import ModelFacts
from ..settings import RegenerateSettings, Sampling
from ..vllm import registry
from ..vllm.engine.errors import EngineError
from ..vllm.registry import VLLMInternalError
from . import acceptance


# The gate's replies are greedy whatever regenerate.sampling says: greedy acceptance is what it measures.
def greedy(max_tokens: int) -> Sampling:
    return Sampling(temperature=0.0, top_p=1.0, top_k=None, max_tokens=max_tokens, seed=0)


# What vLLM 0.32 raises when the target's model class has no SupportsEagle3 (gpu_model_runner.py).
NO_EAGLE3 = "does not support EAGLE3"


class NotServable(Exception):
    """vLLM cannot serve this target with an EAGLE-3 draft: the gate is skipped, with this reason."""


def eagle3_blocker(model_path: str, trust_remote_code: bool) -> str | None:
    """Why vLLM cannot serve this target with an EAGLE-3 draft (None: it can, or it cannot be told
    before an engine starts). Asked of vLLM's model registry before any engine or training, so an
    unsupported target costs seconds. The registry calls are vLLM's own, not a list of ours."""
    archs = ModelFacts.read(model_path).architectures
    try:
        model_registry, supports_eagle3 = registry.load("ModelRegistry"), registry.load("supports_eagle3")
        # the class vLLM would build, through the registry like every vLLM read (vllm/families.py asks the same)
        load_class = registry.member(model_registry, "_ModelRegistry._try_load_model_cls")
    except VLLMInternalError as e:
        if importlib.util.find_spec("vllm") is None:
            return "vLLM is not installed here; the gate needs it to serve the draft"
        return f"{e}; the gate needs it to serve the draft"
    if not archs:
        return None
    try:
        cls = load_class(archs[0])
    except Exception:  # a model vLLM loads only from its folder (remote code): decided when the engine starts
        return None
    if cls is None:
        return None if trust_remote_code else f"vLLM has no model class for {archs[0]}"
    if not supports_eagle3(cls):
        return (
            f"vLLM {_version()} cannot serve {archs[0]} with an EAGLE-3 draft (its model class has no SupportsEagle3)"
        )
    return None


def _version() -> str:
    from ..vllm.registry import installed_version

    return installed_version()


@dataclass
class Generated:
    outputs: list[list[int]]
    spec: list[dict[str, Any]]  # spec-decode counters per prompt (none without a draft)
    engine: dict[str, Any]


def generate(
    model_path: str,
    settings: RegenerateSettings,
    prompts: list[list[int]],
    max_tokens: int,
    stop_ids: list[int],
    max_model_len: int,
    trust_remote_code: bool,
    draft: str | None = None,
    k: int = 3,
) -> Generated:
    """Greedy replies to `prompts` in one engine, `settings`' (with the EAGLE-3 draft at `draft` when given)."""
    from ..regenerate.engine import VLLMEngine

    if draft:
        extra = {"speculative_config": {"method": "eagle3", "model": draft, "num_speculative_tokens": k}}
        engine_args = {**settings.content.engine_args, **extra, "disable_log_stats": False}
        settings = replace(settings, content=replace(settings.content, engine_args=engine_args))
    with VLLMEngine(model_path, settings, greedy(max_tokens), stop_ids, max_model_len, trust_remote_code) as engine:
        try:
            info = engine.start()
        except EngineError as e:
            if draft and NO_EAGLE3 in str(e):
                raise NotServable(f"vLLM cannot serve this target with an EAGLE-3 draft: {e}") from None
            raise
        if not draft:
            return Generated(_run(engine, list(enumerate(prompts))), [], {**info, **engine.volatile})
        # One prompt at a time with the draft: vLLM's counters are per engine, and the gate judges the
        # prompts whose served reply is the one trained on (stage.py), so it needs them per prompt.
        outputs, spec = [], []
        for i, p in enumerate(prompts):
            before = acceptance.counters(engine.llm.get_metrics())
            outputs += _run(engine, [(i, p)])
            spec.append(acceptance.difference(acceptance.counters(engine.llm.get_metrics()), before))
        return Generated(outputs, spec, {**info, **engine.volatile})


def _run(engine: Any, prompts: list[tuple[int, list[int]]]) -> list[list[int]]:
    """The replies to `prompts`, in their order, the engine run until it has no request left."""
    for i, p in prompts:
        engine.add(str(i), p, seed=0)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for f in engine.step():
            done[f.request_id] = f.token_ids
    return [done[str(i)] for i, _ in prompts]
