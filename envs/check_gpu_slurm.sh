#!/usr/bin/env bash
# Does the SLURM executor plugin fit the GPU environment? Without a GPU or CUDA wheels installed:
#  1. pip resolves envs/gpu.txt without its vllm line (a dry run: metadata only; vLLM 0.34.0 pins a flashinfer-python
#     that PyPI lacks, envs/gpu.txt says why), picks exactly the file's other pins, and says which numpy and plugin
#     requirements they are; then vLLM --no-deps;
#  2. pip cannot resolve envs/gpu.txt (without vllm) with the plugin (the numpy clash envs/gpu-slurm.txt names);
#  3. in a scratch venv holding envs/gpu.txt's numpy, pandas, snakemake and the plugin's other requirements,
#     the plugin installed --no-deps from envs/gpu-slurm.txt builds the profile's GPU job line
#     (tests/test_slurm.py's unit test) and parses sacct output with numpy (its efficiency report).
# Needs python3 with venv and PyPI. Usage: bash envs/check_gpu_slurm.sh  (printout: docs/runs/environments/gpu_env_slurm.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
# pip's notes about index locations this machine's pip config names but lacks are noise here
quiet() { grep -v "^WARNING: Location" || true; }
pip() { "$py" -m pip --disable-pip-version-check -q "$@" 2> >(quiet >&2); }
pip install -U pip
pin() { sed -n "s/^$1==//p" envs/gpu.txt; }

echo "== 1. pip install --dry-run envs/gpu.txt but vllm, vllm --no-deps ($("$py" -m pip --version | cut -d' ' -f1-2), $("$py" -V))"
grep -v "^vllm==" envs/gpu.txt >"$work/gpu-no-vllm.txt"
pip install --dry-run --ignore-installed --report "$work/gpu.json" -r "$work/gpu-no-vllm.txt" >/dev/null
pip install --dry-run --ignore-installed --no-deps --report "$work/vllm.json" "vllm==$(pin vllm)" >/dev/null
"$py" - "$work/gpu.json" "$work/vllm.json" envs/gpu.txt <<'PY'
import json, re, sys
def norm(name): return re.sub(r"[-_.]+", "-", name).lower()
picked = {norm(i["metadata"]["name"]): i["metadata"]["version"]
          for f in sys.argv[1:3] for i in json.load(open(f))["install"]}
pinned = dict(ln.split("==") for ln in open(sys.argv[3]).read().splitlines() if "==" in ln and ln[0] != "#")
print("the resolution is envs/gpu.txt:", picked == pinned, f"({len(picked)} distributions)")
names = ("vllm", "torch", "numpy", "pandas", "pyyaml", "throttler", "snakemake",
         "snakemake-interface-common", "snakemake-interface-executor-plugins", "mistral-common")
print("resolved:", ", ".join(f"{n} {picked.get(n, picked.get(n.replace('-', '_'), '?'))}" for n in names))
PY

echo "== 2. the same with the plugin resolved too, numpy left to pip (envs/gpu.txt without its numpy pin)"
grep -v "^numpy==" "$work/gpu-no-vllm.txt" >"$work/gpu-any-numpy.txt"
if "$py" -m pip install --dry-run --ignore-installed -r "$work/gpu-any-numpy.txt" -r envs/gpu-slurm.txt >"$work/clash.log" 2>&1; then
    echo "resolved: the clash is gone; envs/gpu-slurm.txt could move into envs/gpu.txt"
else
    grep -o "ResolutionImpossible" "$work/clash.log" | head -1
    grep -E "plugin-slurm [0-9.]+ depends on numpy|mistral-common [0-9.]+ depends on numpy<" "$work/clash.log" | sort -u -V | tail -3
fi

echo "== 3. the plugin --no-deps beside envs/gpu.txt's numpy $(pin numpy)"
deps=(numpy pandas pyyaml psutil snakemake throttler snakemake-interface-common snakemake-interface-executor-plugins pytest)
pip install $(for d in "${deps[@]}"; do echo "$d==$(pin "$d")"; done)
pip install --no-deps -r envs/gpu-slurm.txt
"$py" -m pip list 2>/dev/null | grep -iE "^(numpy|pandas|snakemake-executor-plugin-slurm(-jobstep)?) " | tr -s ' '
echo "pip check (the one requirement --no-deps leaves unmet):"
"$py" -m pip check || true
"$py" -m pytest -q -p no:cacheprovider tests/test_slurm.py -k tensor_parallel_job 2>&1 | tail -1
"$py" - <<'PY'
import logging
import numpy
from snakemake_executor_plugin_slurm.efficiency_report import parse_sacct_data
lines = [
    "101|job-a|extract|00:10:00|00:40:00|1|8|0|16000M",
    "101.batch|batch||00:10:00|00:00:01|1|8|900M|",
    "101.0|python||00:10:00|00:39:00|1|8|12000M|",
    "102|job-b|validate|00:00:00|00:00:00|1|1|0|2000M",
    "102.0|python||00:00:00|00:00:00|1|1|100M|",
]
df = parse_sacct_data(lines, 0.0, "run", logging.getLogger("check"))
print(f"efficiency report with numpy {numpy.__version__}: {len(df)} job steps,",
      "CPU % " + ", ".join(f"{x:.1f}" for x in df["CPU Efficiency (%)"]),
      "| memory % " + ", ".join(f"{x:.1f}" for x in df["Memory Usage (%)"]))
PY
