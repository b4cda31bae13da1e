"""The extract stage's one seam to the engines: which capture backend a shard gets, built from its CaptureSpec.
The engines' modules are imported only here, when a shard needs them (vLLM's import costs seconds)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..backends.empty import EmptyShardBackend

if TYPE_CHECKING:
    from ..backends.base import CaptureBackend, CaptureSpec

BACKENDS = ("hf", "vllm")


def make_backend(spec: CaptureSpec) -> CaptureBackend:
    """The backend extract.backend names, for the one capture `spec` describes."""
    if spec.backend == "hf":
        from ..backends.hf import HFBackend

        return HFBackend(spec)
    if spec.backend == "vllm":
        from ..vllm.capture.backend import VLLMBackend

        return VLLMBackend(spec)
    raise ValueError(f"extract.backend = {spec.backend!r} is not one of {list(BACKENDS)}")


def empty_backend(spec: CaptureSpec) -> EmptyShardBackend:
    """The backend of a shard without rows: no engine started, the installed one's version named."""
    return EmptyShardBackend(spec, engine_version(spec.backend))


def engine_version(backend: str) -> str:
    """The installed version of the engine `backend` would have started, without starting it: an empty
    shard's manifest names the same engine as its neighbours'."""
    if backend == "vllm":
        from ..vllm.registry import version_text

        return version_text()
    import transformers

    return transformers.__version__
