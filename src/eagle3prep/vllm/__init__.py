"""Everything eagle3prep knows of vLLM, in one wing.

What every job that starts vLLM shares (extract's capture backend, the regenerate stage, the gate) and validation
reads: registry.py (every vLLM name the code reads, each version gate, the one line when one is missing),
engine/ (starting and stopping an engine, its known bugs' workarounds, its failures as one line), memory.py (the
GPU memory vLLM's budget does not see), families.py (which capture path takes a model family).
capture/: extract's capture backend, by capture path (hooks/, builtin/) around the loop they share.
Nothing here imports vLLM or torch at import time: the Snakefile's parse imports parts of the package."""
