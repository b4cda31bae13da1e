#!/usr/bin/env bash
# Runs once inside the new conda env (envs/gpu.yaml): vLLM, then the workflow's own package and speculators (training
# and the overfit gate), all --no-deps as in `make gpu-env`: vLLM 0.34.0 pins a flashinfer-python that PyPI lacks
# (envs/gpu.txt says why; gpu.yaml holds the rest of its environment), envs/speculators.txt says why for speculators.
set -euo pipefail
pip install --no-deps vllm==0.34.0  # envs/gpu.txt's (tests/test_envs.py)
pip install --no-deps -e "${EAGLE3PREP_ROOT:?the Snakefile sets EAGLE3PREP_ROOT}"
pip install --no-deps -r "$EAGLE3PREP_ROOT/envs/speculators.txt"
