"""Capture backends: one interface (base.CaptureBackend, fed one base.CaptureSpec), one module per engine: hf.py,
empty.py, and vLLM's in vllm/capture/backend.py (the vLLM wing). Which one a shard gets is the extract stage's
(extract/backend.py); nothing here imports an engine's wing."""
