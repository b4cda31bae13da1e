"""The vLLM backend: driver.py (engine, probe, shard stream), paths.py (hooks / built-in capture),
worker.py (runs inside vLLM's workers), compat.py (what differs between vLLM versions), errors.py
(engine failures as one line). Nothing here imports vLLM at import time."""
