#!/usr/bin/env bash
# tests/test_slurm.py's one-node cluster run (the CPU demo through profiles/slurm as SLURM jobs, byte-identical
# to a local run) with envs/gpu.txt's numpy put in front of .venv's: the SLURM plugin as .venv-gpu has it, the
# versions of envs/gpu-slurm.txt beside numpy < 2.4. The main Snakemake process runs the executor plugin; its
# jobs get the same PYTHONPATH (the plugin submits with --export=ALL).
# `make test-slurm` runs it after tests/test_slurm.py. Needs .venv and PyPI; as root with Slurm installed
# (.ci/install-slurm.sh) the cluster test runs, otherwise it is skipped as in `make test-slurm`.
# Usage: bash envs/check_gpu_slurm_cluster.sh   (printout: docs/runs/environments/gpu_env_slurm.txt, its second part)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${VENV:-.venv}/bin/python  # VENV: another checkout's .venv
numpy=$(sed -n 's/^numpy==//p' envs/gpu.txt)
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$py" -m pip install -q --disable-pip-version-check --no-deps --target "$site" "numpy==$numpy" \
    2> >(grep -v "^WARNING: Location" >&2 || true)
export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$py" - <<'PY'
import importlib.metadata as md
import numpy
plugins = ("snakemake-executor-plugin-slurm", "snakemake-executor-plugin-slurm-jobstep", "snakemake")
print(f"numpy {numpy.__version__} ({numpy.__file__.split('/numpy/')[0]} first on the path);",
      ", ".join(f"{p} {md.version(p)}" for p in plugins))
PY
"$py" -m pytest -q -p no:cacheprovider -m slurm tests/test_slurm.py 2>&1 | grep -E "passed|failed|SKIPPED|Error" | tail -3
