"""Capture backends: one interface (base.CaptureBackend), one module per engine: hf.py, empty.py, and vLLM's in
vllm/capture/backend.py (the vLLM wing)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import CaptureBackend, CaptureSpec

if TYPE_CHECKING:
    from ..model_facts import ModelFacts
    from ..settings import ExtractSettings

BACKENDS = ("hf", "vllm")


def make_backend(spec: CaptureSpec, settings: ExtractSettings, facts: ModelFacts | None = None) -> CaptureBackend:
    """Build the backend named by spec.backend; engines are imported only here. `facts`: the model's, when
    the job has read them (the vllm probe needs them)."""
    if spec.backend == "hf":
        from .hf import HFBackend

        return HFBackend(spec, settings)
    if spec.backend == "vllm":
        from ..vllm.capture.backend import VLLMBackend

        return VLLMBackend(spec, settings, facts)
    raise ValueError(f"extract.backend = {spec.backend!r} is not one of {list(BACKENDS)}")
