#!/usr/bin/env bash
# Runs once inside the new conda env (envs/cpu.yaml): the workflow's own package, from the checkout.
set -euo pipefail
pip install --no-deps -e "${EAGLE3PREP_ROOT:?the Snakefile sets EAGLE3PREP_ROOT}"
