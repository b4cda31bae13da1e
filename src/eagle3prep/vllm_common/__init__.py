"""What every job that starts vLLM shares (extract's capture backend, the regenerate stage, the gate) and what
validation reads of it: versions.py (which vLLM is installed), workarounds.py (engine bugs that capture wrong
states, the engine kwargs that avoid them), errors.py (a failed start as one line with the children's root
cause), launch.py (starting one: workarounds resolved, `vllm.LLM`, the shared memory recorded), shutdown.py
(stopping one). What only the capture backend needs is in backends/vllm/.
Nothing here imports vLLM or torch at import time: the Snakefile's parse imports parts of the package."""
