"""Capture backends: one interface (base.CaptureBackend), one module per engine."""

from __future__ import annotations

from typing import Any

from .base import CaptureBackend, CaptureSpec

BACKENDS = ("hf", "vllm")


def make_backend(spec: CaptureSpec, options: dict[str, Any]) -> CaptureBackend:
    """Build the backend named by spec.backend; engines are imported only here."""
    if spec.backend == "hf":
        from .hf import HFBackend

        return HFBackend(spec, options)
    if spec.backend == "vllm":
        from .vllm.driver import VLLMBackend

        return VLLMBackend(spec, options)
    raise ValueError(f"extract.backend = {spec.backend!r} is not one of {list(BACKENDS)}")
