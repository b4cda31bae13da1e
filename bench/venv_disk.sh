#!/usr/bin/env bash
# Peak disk of installing envs/vllm-0.16.txt (CUDA-build torch and its NVIDIA wheels, from PyPI): one pip call for
# the whole file, then the Makefile's way (each torch/NVIDIA wheel in a call of its own). The peak is the used
# space of the venv's filesystem, sampled every second, less the space used before; other writers on that
# filesystem would add to it. Needs PyPI and about 12 GB free. With `vllm`: the Makefile's .venv-vllm alone.
# Usage: bash bench/venv_disk.sh [vllm]   (printout: docs/runs/environments/venv_disk.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm016
[ "${1:-}" = vllm ] && venv=.venv-vllm
[ -e "$venv" ] && { echo "$venv exists: remove it first (this script builds it)" >&2; exit 2; }
flags="-qq --disable-pip-version-check --no-cache-dir"
used() { df --output=used -B1M . | tail -1; }
SAMPLER=
trap '[ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null' EXIT  # a failed install leaves no sampler behind

measure() {  # $1: label; the rest: the command that builds $venv
    local label=$1; shift
    local base peak start samples
    base=$(used)
    samples=$(mktemp)
    (while true; do used >>"$samples"; sleep 1; done) &
    SAMPLER=$!
    start=$(date +%s)
    "$@"
    kill "$SAMPLER"; wait "$SAMPLER" 2>/dev/null || true
    peak=$(sort -n "$samples" | tail -1)
    printf '%-34s peak %6.1f GB above the start, installed %6.1f GB, %4d s\n' "$label" \
        "$(echo "($peak - $base) / 1024" | bc -l)" "$(du -sm "$venv" | awk '{print $1 / 1024}')" \
        "$(($(date +%s) - start))"
    rm -f "$samples"
}

one_call() {
    python3 -m venv "$venv"
    "$venv/bin/pip" install $flags --no-deps -r envs/vllm-0.16.txt
}

echo "$(date -u +%F) $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- Makefile || echo ' with a changed Makefile') $(python3 --version), $(nproc) cores; command: bash bench/venv_disk.sh $*"
if [ "$venv" = .venv-vllm ]; then
    measure "make $venv" make -s "$venv/.installed" QUIET_PIP=-qq
    exit
fi
measure "one pip call for the file" one_call
rm -rf "$venv"
measure "make (a call a CUDA wheel)" make -s "$venv/.installed" QUIET_PIP=-qq
"$venv/bin/python" -c "import torch, vllm; print('import: torch', torch.__version__, 'vllm', vllm.__version__)" 2>&1 \
    | grep -E "^import" || true
