"""A vLLM engine's life, the same for every job that starts one: launch.py (start: the known engine bugs'
workarounds resolved, `vllm.LLM`; stop), workarounds.py (engine bugs that capture wrong states, the engine kwargs
that avoid them), errors.py (a failed start or a death mid-run as one line with the children's root cause)."""
