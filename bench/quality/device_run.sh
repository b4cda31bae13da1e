#!/bin/bash
# The quality bench on the H200 after the payloads (bench/device/README.md), in the background of a warm
# machine. Independent branches share the one GPU (every engine gets a fixed KV cache: run.py ENGINE_SHARE):
#   ours' data, then: its drafts | fp8 | mxfp4 | all_ids -> planted | peer       offpolicy's data from the start
# each branch trains its drafts (seeds 0 and 1; planted: seed 0) and serves them as soon as they exist.
# Acceptance does not depend on what else runs; tokens/s does, so the last step serves the target alone
# and ours_s0 again on an idle GPU (serve/speed_*.json).
# Usage: setsid nohup bash bench/quality/device_run.sh /tmp/q > /tmp/q/run.log 2>&1 &
# BRANCHES="ours peer" runs only those (of offpolicy ours fp8 mxfp4 planted peer speed) beside the target's own serve:
# for a device session too short for all.
. "$(dirname "$0")/device_common.sh" "$1"
ALL="offpolicy ours fp8 mxfp4 planted peer speed"
for b in ${BRANCHES:-}; do  # a misspelt branch would run nothing of it, silently
  case " $ALL " in *" $b "*) ;; *) log "BRANCHES: no branch $b (of $ALL)"; exit 2 ;; esac
done
want() { case " ${BRANCHES:-$ALL} " in *" $1 "*) return 0 ;; esac; return 1; }

train_serve() {  # variant seeds...: train side by side, then serve each draft
  local v=$1; shift
  log "train $v ($*)"
  for s in "$@"; do $R --stage train --variants "$v" --seeds "$s" > "$Q/train_${v}_s$s.log" 2>&1 & done
  wait
  log "serve $v"
  $R --stage serve --only $(for s in "$@"; do echo "${v}_s$s"; done) > "$Q/serve_$v.log" 2>&1
  log "done $v"
}

[ -f "$Q/target/target.json" ] || $R --stage target > "$Q/target.log" 2>&1 || exit 1
log "data ours, offpolicy"
want offpolicy && ($R --stage data --variants offpolicy > "$Q/data_offpolicy.log" 2>&1; train_serve offpolicy 0 1) &
$R --stage data --variants ours > "$Q/data_ours.log" 2>&1 || { log "ours' data failed"; wait; exit 1; }
log "ours' data done"
$R --stage serve --only target_only > "$Q/serve_target_only.log" 2>&1 &  # summarize.py compares with it
want ours && train_serve ours 0 1 &
want fp8 && ($R --stage data --variants fp8 > "$Q/data_fp8.log" 2>&1; train_serve fp8 0 1) &
want mxfp4 && ($R --stage data --variants mxfp4 > "$Q/data_mxfp4.log" 2>&1; train_serve mxfp4 0 1) &
want planted && ($R --stage data --variants all_ids > "$Q/data_all_ids.log" 2>&1 && $R --stage plant > "$Q/plant.log" 2>&1 &&
  for v in planted_layer_plus_one planted_post_norm_final planted_tokens_shifted; do train_serve $v 0 & done; wait) &
want peer && ($R --stage peer > "$Q/peer.log" 2>&1 && train_serve peer 0 1) &
wait
want speed || { log "all done"; exit 0; }
log "speed: target alone and ours_s0 on an idle GPU"
$R --stage serve --tag speed_ --only target_only ours_s0 > "$Q/serve_speed.log" 2>&1
log "all done"
