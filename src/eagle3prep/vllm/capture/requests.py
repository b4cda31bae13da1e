"""A shard row's request as the driver adds it: its tag and sampling params, and for a logits-check row its prompt
logprobs, asked of vLLM in windows the GPU memory holds (vllm/memory.py)."""

from __future__ import annotations

from typing import Any, NamedTuple

from ...shard.sink import PROBE_SUFFIX
from ...tokenize.row_inputs import ImageRow
from .. import registry
from ..memory import LOGPROB_WINDOW

# SamplingParams.extra_args key that carries our own request tag to the worker. vLLM >= 0.11 rewrites
# LLM.generate's request ids inside the engine ("<id>-<8 random chars>"), so the driver cannot know
# the id a worker sees; the tag travels with the request unchanged.
TAG_KEY = "eagle3prep_tag"


class CaptureError(RuntimeError):
    """The engine returned hidden states that do not match the request (layers, shapes, tokens)."""


def sampling_params(tag: str, extra: dict[str, Any] | None = None, logprobs: bool = False) -> Any:
    SamplingParams = registry.load("SamplingParams")  # noqa: N806 - a class

    # One output token: the prompt's forward is all we need. The tag lets the worker (hooks) and
    # the connector (builtin) attribute rows to requests whatever ids vLLM assigns internally.
    # prompt_logprobs=0: the logprob of each actual prompt token (validate's logits check).
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        extra_args={TAG_KEY: tag, **(extra or {})},
        **({"prompt_logprobs": 0} if logprobs else {}),
    )


def request_tag(params: Any, default: str | None = None) -> str | None:
    """The tag a request's SamplingParams carry (None: vLLM's own request, e.g. the engine's warm-up)."""
    extra = registry.member(params, "SamplingParams.extra_args") if params is not None else None
    return (extra or {}).get(TAG_KEY, default)


def prompt_logprobs(out: Any, ids: list[int]) -> Any:
    """[T-1] float32 logprobs of tokens 1.. of a finished request (vLLM's position 0 has none)."""
    import torch

    per_pos = registry.member(out, "RequestOutput.prompt_logprobs") or []
    if len(per_pos) != len(ids):
        tag = registry.member(out, "RequestOutput.request_id")
        raise CaptureError(f"request {tag}: {len(per_pos)} prompt logprobs for {len(ids)} tokens")
    logprobs = [registry.member(per_pos[t][ids[t]], "Logprob.logprob") for t in range(1, len(ids))]
    return torch.tensor(logprobs, dtype=torch.float32)


class Probe(NamedTuple):
    """The prefix request of a logits-check row longer than LOGPROB_WINDOW: its first tokens, prompt logprobs on."""

    tag: str
    ids: list[int]
    params: Any


def logprob_request(tag: str, ids: list[int], window: int | None = None) -> tuple[Any, Probe | None, str]:
    """How a logits-check row asks for its prompt logprobs without vLLM computing them over a whole long chunk
    at once (vllm/memory.py): (the row's own params, its prefix request or None, a note when the check
    covers only part of the row or none of it)."""
    window = window or LOGPROB_WINDOW
    if len(ids) <= window:
        return sampling_params(tag, logprobs=True), None, ""
    if isinstance(ids, ImageRow):  # a prefix could cut an image's placeholder tokens in two
        return sampling_params(tag), None, f"row {tag}: {len(ids)} tokens with images, over {window}: no logits check"
    probe = tag + PROBE_SUFFIX
    note = f"row {tag}: logits check on its first {window} of {len(ids)} tokens"
    return sampling_params(tag), Probe(probe, list(ids[:window]), sampling_params(probe, logprobs=True)), note
