#!/bin/bash
# Every kill point of tests/test_faults.py (23 of them; `make test` runs 7, one of each kind): SIGKILL the run
# there, run the README's command again, and compare the dataset byte for byte with an uninterrupted run.
# About 15 minutes on 2 cores. Writes docs/runs/fault_matrix_<date>.txt (pytest's summary and each point's time).
#   bash bench/fault_matrix.sh        (from the project root, after `make .venv/.installed`)
set -uo pipefail
out=docs/runs/fault_matrix_$(date +%F).txt
{
  echo "# $(date -u '+%F %T') UTC, $(git rev-parse --short HEAD), $(nproc) CPUs: EAGLE3PREP_ALL_FAULTS=1 pytest tests/test_faults.py"
  EAGLE3PREP_ALL_FAULTS=1 .venv/bin/pytest tests/test_faults.py -p no:cacheprovider -q -rA --durations=0 2>&1 \
    | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|s (call|setup)"
} | tee "$out"
grep -q " failed\| error" "$out" && exit 1 || exit 0
