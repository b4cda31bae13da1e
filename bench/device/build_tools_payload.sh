#!/bin/bash
# Builds, on a machine that reaches PyPI, the wheels the quality bench (bench/quality/) needs on the
# offline H200 machine beside vLLM: Snakemake (the workflow as a user runs it), speculators 0.9.0 and
# what its trainer imports, pinned as in envs/. Writes .whl/tools/ (one part, carried in one call):
#   bash bench/device/build_tools_payload.sh
# On the device, one call per part: bash .whl/tK/install_tools.sh (then . /tmp/tools/env.sh)
# What the device image already has (torch, transformers, numpy, CUDA wheels) is left out.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(pwd)
W=${W:-/tmp/tools-payload}
rm -rf "$W" && mkdir -p "$W/wheels"
PLAT=""; for n in 17 24 26 27 28 31 34 35; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform linux_x86_64"
reqs="$W/reqs.txt"
grep -E '^(snakemake|pyyaml|jsonschema|pandas|pyarrow|datasets|safetensors|tqdm|psutil|matplotlib)==' envs/base.txt > "$reqs"
grep -vE '^#|^$' envs/speculators.txt >> "$reqs"
# Pure-Python packages that PyPI has only as source (connection_pool): built into a wheel here first.
python3 -m pip wheel -q --no-deps -w "$W/wheels" connection_pool==0.0.3
python3 -m pip download -q --find-links "$W/wheels" --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  $PLAT -d "$W/wheels" -r "$reqs"
# The device's own stack stays (a second torch/transformers/numpy/CUDA runtime would shadow it), and
# what the vLLM payload already brings (vllm-0.26.0-deps.txt) or the image has (pyarrow, pandas, pyyaml,
# safetensors, psutil, tqdm, seen there on 2026-12-01) is not carried twice. The bench targets
# the export, not the report, so matplotlib's stack stays behind too; pulp too (it runs Snakemake with
# --scheduler greedy), and hf_xet (no hub downloads offline).
cd "$W/wheels"
rm -f torch-* transformers-* numpy-* nvidia_* triton-* tokenizers-* huggingface_hub-* sympy-* networkx-* \
  torchvision-* torchaudio-* setuptools-* fsspec-* jinja2-* markupsafe-* filelock-* cuda_* mpmath-* \
  matplotlib-* fonttools-* kiwisolver-* pillow-* contourpy-* cycler-* pyparsing-* hf_xet-* pulp-* \
  pyarrow-* pandas-* python_dateutil-* tzdata-* psutil-* tqdm-* pyyaml-* safetensors-*
for pin in $(cut -d= -f1 "$HERE/vllm-0.26.0-deps.txt" | tr 'A-Z-' 'a-z_'); do rm -f "$pin"-[0-9]*; done
tar -cf "$W/tools.tar" -- *.whl
sum=$(sha256sum "$W/tools.tar" | cut -d' ' -f1)
tree=$(cd "$ROOT" && git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
part_mb=${PART_MB:-$(((64 * 1048576 - tree) / 1048576 - 2))}
cd "$W" && split -b "${part_mb}M" -d tools.tar part.
parts=$(ls part.* | wc -l)
rm -rf "$ROOT/.whl"/t[0-9]* && i=0
for p in part.*; do
  i=$((i + 1)); d="$ROOT/.whl/t$i"; mkdir -p "$d"; mv "$p" "$d/"
  printf '%s %s\n' "$sum" "$parts" > "$d/payload.info"
  cp "$HERE/install_tools.sh" "$d/"
done
grep -qx '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.whl/' >> "$ROOT/.git/info/exclude"
du -sh "$ROOT"/.whl/t*
echo "built $parts parts: carry .whl/t1, .whl/t2, ... one per call, each starting with bash .whl/tK/install_tools.sh"
