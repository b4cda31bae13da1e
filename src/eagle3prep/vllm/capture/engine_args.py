"""The arguments vllm.LLM is started with for a capture, assembled from the capture's settings, the model's facts,
the capture path's needs and the known engine bugs' workarounds (DESIGN.md §5); and the GPU memory plan that may
lower gpu_memory_utilization (vllm/memory.py), applied by planned_kwargs. Plain functions of plain values: tested
without vLLM (tests/test_vllm_choice.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...config.model import VLLM_SAMPLED_TOKENS
from ...tokenize.vision import EXPANDS
from .. import memory
from ..engine.workarounds import merge_engine_kwargs

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ...backends.base import CaptureSpec
    from ...model_facts import ModelFacts


def engine_kwargs(
    spec: CaptureSpec, facts: ModelFacts, path_kwargs: Mapping[str, Any], workaround_kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """vllm.LLM's keyword arguments for `spec` on a model of `facts`, the capture path's `path_kwargs` and the
    workarounds' on top; those left None are left out (vLLM's default)."""
    content, speed = spec.settings.content, spec.settings.speed
    kwargs: dict[str, Any] = {
        "model": spec.model_path,
        # We hand over token ids; the engine needs no tokenizer, except for a target we feed images to
        # (tokenize's EXPANDS): vLLM builds its multimodal processor with it. Kimi-K2.5 (a VLM wrapper
        # whose images are not fed yet) keeps skipping it: its tokenizer would need trust_remote_code.
        "skip_tokenizer_init": facts.vision_model_type not in EXPANDS,
        "dtype": spec.dtype,
        "tensor_parallel_size": spec.tp_size,
        # the sampled token must fit after a prompt of max_seq_len tokens (parse checks the context has room)
        "max_model_len": spec.max_seq_len + VLLM_SAMPLED_TOKENS,
        "max_num_batched_tokens": speed.max_num_batched_tokens,
        "gpu_memory_utilization": speed.gpu_memory_utilization,
        "enforce_eager": content.enforce_eager,
        "quantization": content.quantization,
        # A prefix-cache hit skips the forward of the cached tokens: their rows would be missing.
        "enable_prefix_caching": False,
        "trust_remote_code": spec.trust_remote_code,
        "seed": 0,
    }
    kwargs.update(path_kwargs)
    kwargs.update(content.engine_args)  # the user's word wins, as documented...
    kwargs.update(path_kwargs)  # ...except where a capture path needs its setting (hooks: eager)
    if facts.vision_model_type in EXPANDS:
        # Image rows' requests are made by several workers (images.RequestPool); vLLM's processor cache is
        # not made for that (its sender side mirrors the engine's cache in the order requests are made).
        kwargs["mm_processor_cache_gb"] = 0
    kwargs = merge_engine_kwargs(kwargs, dict(workaround_kwargs))  # known engine bugs
    if kwargs.get("enable_prefix_caching"):
        raise ValueError("extract.engine_args.enable_prefix_caching must stay false: cached tokens are not captured")
    return {k: v for k, v in kwargs.items() if v is not None}


def memory_plan(
    spec: CaptureSpec, facts: ModelFacts, kwargs: Mapping[str, Any], total_bytes: int | None
) -> memory.MemoryPlan:
    """Room outside vLLM's budget for the logits check's prompt logprobs and the hooks' step copies, on a card of
    `total_bytes` (memory.gpu_total_bytes)."""
    speed = spec.settings.speed
    step = int(kwargs.get("max_num_batched_tokens") or speed.max_num_batched_tokens)
    need = memory.hooks_peak_bytes(step, facts.hidden_size or 0, len(spec.layer_ids))
    if spec.settings.content.logprob_rows:
        need += memory.logprob_peak_bytes(facts.vocab_size or 0, min(memory.LOGPROB_WINDOW, step))
    return memory.plan(float(kwargs["gpu_memory_utilization"]), total_bytes, need)


def planned_kwargs(
    spec: CaptureSpec, facts: ModelFacts, kwargs: Mapping[str, Any], total_bytes: int | None
) -> tuple[dict[str, Any], str]:
    """`kwargs` with gpu_memory_utilization as memory_plan sets it on a card of `total_bytes`, and the plan's one
    line (for the job's log and the manifest)."""
    plan = memory_plan(spec, facts, kwargs, total_bytes)
    return {**kwargs, "gpu_memory_utilization": plan.gpu_memory_utilization}, plan.note
