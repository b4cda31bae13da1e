#!/bin/bash
# The quality bench on the H200 after the payloads (bench/device/README.md), in the background of a warm
# machine. Independent branches share the one GPU (every engine gets a fixed KV cache: run.py ENGINE_SHARE):
#   ours' data, then: its drafts | fp8 | mxfp4 | all_ids -> planted | peer       offpolicy's data from the start
# each branch trains every (draft type, seed) at once, a process each (seeds 0 and 1; planted: seed 0), and serves
# each draft as soon as it exists, at most SERVE_SLOTS (default 8) engines at once over all branches.
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

# GPU memory, estimated (gpu_memory.log measures it): an engine ~3.5 GiB (serve.py's 2 GiB KV cache, the 67 MB
# target, CUDA context and graphs), a trainer ~1-3 GiB (a one-layer draft 512 wide, 2,048 draft ids, one 4,096-token
# batch); at worst 8 engines beside two branches' 16 trainers, ~28 + 16-48 of an H100's ~79 GiB, where each engine's
# start also asks 8 GiB free (gpu_memory_utilization 0.1). The slots also spread the engines' CPU-heavy starts.
command -v flock > /dev/null || { log "no flock (util-linux): the serve slots need it"; exit 2; }
slot() {  # "$@" holding one of SERVE_SLOTS lock files (-o: the engine's own processes do not hold it)
  local i rc
  while :; do
    for ((i = 0; i < ${SERVE_SLOTS:-8}; i++)); do
      flock -n -o -E 75 "$Q/serve_slot$i.lock" "$@"; rc=$?
      [ $rc = 75 ] || return $rc
    done
    sleep 5
  done
}

train_serve() {  # variant seeds...: each (draft type, seed) a process of its own: train, then serve its draft
  local v=$1 s k n; shift
  log "train $v ($*: ${DRAFTS:-eagle3})"
  for s in "$@"; do
    for k in ${DRAFTS:-eagle3}; do
      n=${v}_s$s; [ "$k" = eagle3 ] || n+=_$k  # run.py draft_folder; --drafts $k overrides $R's
      ($R --stage train --variants "$v" --seeds "$s" --drafts "$k" > "$Q/train_$n.log" 2>&1
        # a type the trainer refused (mtp on this Llama) has no checkpoints to serve
        [ -d "$Q/drafts/$n/checkpoints" ] && slot $R --stage serve --only "$n" --drafts "$k" > "$Q/serve_$n.log" 2>&1
        log "done $n") &
    done
  done
  wait
  log "done $v"
}

# the GPU's memory in use every 30 s, and each process's: the estimate above, measured (disowned: `wait` skips it)
(while :; do date +%T; nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; sleep 30; done) > "$Q/gpu_memory.log" 2>&1 &
mem=$!; disown; trap 'kill $mem' EXIT
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
