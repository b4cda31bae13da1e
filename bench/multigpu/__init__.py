"""The parts of bench/multi_gpu.py, the entry point (its docstring says what the bench does and how to
run it): checks, targets, sampling, run, report and the scenarios, one concern a module."""

from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
SCRIPT = BENCH / "multi_gpu.py"  # the child processes (_build, _moe_config, moe-prefill's --phase) run it again
