#!/bin/bash
# The quality bench on the H200 after the payloads (bench/device/README.md), in the background of a warm
# machine: the target, then each phase's data, its drafts (seeds 0 and 1 side by side on the one GPU), and
# vLLM serving every draft not served yet. A phase is a list of variants, or "planted" (all_ids' rows,
# then the planted mistakes, one draft each: seed 0), or "peer" (ours' rows, speculators' own hidden states).
# Usage: setsid nohup bash bench/quality/device_run.sh /tmp/q "ours" peer planted "offpolicy fp8" > /tmp/q/run.log 2>&1 &
set -u
Q=$1; shift
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
. /tmp/site/env.sh && . /tmp/tools/env.sh
R="python3 bench/quality/run.py $Q"
[ -f "$Q/target/target.json" ] || $R --stage target > "$Q/target.log" 2>&1 || exit 1
for phase in "$@"; do
  tag=${phase// /_}
  echo "phase $phase: data $(date +%T)"
  if [ "$phase" = planted ]; then
    $R --stage data --variants all_ids > "$Q/data_all_ids.log" 2>&1
    $R --stage plant > "$Q/plant.log" 2>&1
    variants="planted_layer_plus_one planted_post_norm_final planted_tokens_shifted"; seeds=0
  elif [ "$phase" = peer ]; then
    $R --stage peer > "$Q/peer.log" 2>&1
    variants=peer; seeds="0 1"
  else
    $R --stage data --variants $phase > "$Q/data_$tag.log" 2>&1
    variants=$phase; seeds="0 1"
  fi
  echo "phase $phase: train $(date +%T)"
  for v in $variants; do for s in $seeds; do
    $R --stage train --variants $v --seeds $s > "$Q/train_${v}_s$s.log" 2>&1 &
  done; done
  wait
  echo "phase $phase: serve $(date +%T)"
  $R --stage serve > "$Q/serve_$tag.log" 2>&1
done
echo "all done $(date +%T)"
