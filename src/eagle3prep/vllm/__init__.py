"""Everything eagle3prep knows of vLLM, in one wing.

What every job that starts vLLM shares (extract's capture backend, the regenerate stage, the gate) and validation
reads: names.py (every vLLM name the code reads and each version gate, as data), registry.py (how code reads them,
the one line when one is missing), engine/ (starting and stopping an engine, its known bugs' workarounds, its
failures as one line), memory.py (the GPU memory vLLM's budget does not see), families.py (whether the installed
vLLM has a family's EAGLE-3 interface). capture/: extract's capture backend: the path choice, the engine's
arguments, the loop both capture paths (hooks/, builtin/) share.
Nothing here imports vLLM or torch at import time: the Snakefile's parse imports parts of the package."""
