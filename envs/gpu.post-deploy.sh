#!/usr/bin/env bash
# Runs once inside the new conda env (envs/gpu.yaml): the workflow's own package and speculators (training and
# the overfit gate), both --no-deps as in `make gpu-env` (envs/speculators.txt says why).
set -euo pipefail
pip install --no-deps -e "${EAGLE3PREP_ROOT:?the Snakefile sets EAGLE3PREP_ROOT}"
pip install --no-deps -r "$EAGLE3PREP_ROOT/envs/speculators.txt"
