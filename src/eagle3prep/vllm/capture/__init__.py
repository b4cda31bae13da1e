"""Extract's vLLM capture backend, by capture path: backend.py (VLLMBackend: probe, engine start, a shard),
choice.py (choose: which path takes the model on this vLLM), engine_args.py (what vllm.LLM is started with),
loop.py (the driver's phases of a shard, shared by both paths), feed.py (each row's request, made ahead),
requests.py (a row's sampling params), images.py (requests of rows with images, made on threads), message.py
(what the driver and the worker say), worker.py (the worker's half of a shard, shared by both paths); hooks/
and builtin/ hold what only one path needs. Nothing here imports vLLM at import time."""
