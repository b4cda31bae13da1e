"""The vLLM capture backend: driver.py (engine, probe, shard stream), paths.py (hooks / built-in capture),
worker.py (runs inside vLLM's workers), connector.py (the built-in path's connector), compat.py (what the
capture paths tell apart between vLLM versions), internals.py (the vLLM internals the hooks read, each checked).
What the regenerate stage, the gate and validation share about vLLM is in vllm_common/. Nothing here imports
vLLM at import time."""
