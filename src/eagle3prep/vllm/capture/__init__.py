"""Extract's vLLM capture backend, by capture path: backend.py (VLLMBackend: probe, engine start, a shard),
choice.py (which path takes the model on this vLLM), loop.py (the driver's half of a shard, shared by both
paths), requests.py (a row's request), images.py (requests of rows with images, made on threads), message.py
(what the driver and the worker say), worker.py (the worker's half of a shard, shared by both paths); hooks/
and builtin/ hold what only one path needs. Nothing here imports vLLM at import time."""
