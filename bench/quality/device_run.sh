#!/bin/bash
# The quality bench on the H200 after the payloads (bench/device/README.md), in the background of a warm
# machine: target, then per phase the workflow's data, two drafts trained side by side, and vLLM serving.
# Usage: setsid nohup bash bench/quality/device_run.sh /tmp/q "ours" "offpolicy fp8" > /tmp/q/run.log 2>&1 &
set -u
Q=$1; shift
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
. /tmp/site/env.sh && . /tmp/tools/env.sh
R="python3 bench/quality/run.py $Q"
[ -f "$Q/target/target.json" ] || $R --stage target > "$Q/target.log" 2>&1 || exit 1
for phase in "$@"; do
  echo "phase $phase: data $(date +%T)"
  $R --stage data --variants $phase > "$Q/data_${phase// /_}.log" 2>&1
  echo "phase $phase: train $(date +%T)"
  for s in 0 1; do $R --stage train --variants $phase --seeds $s > "$Q/train_${phase// /_}_s$s.log" 2>&1 & done
  wait
  echo "phase $phase: serve $(date +%T)"
  $R --stage serve > "$Q/serve_${phase// /_}.log" 2>&1
done
echo "all done $(date +%T)"
