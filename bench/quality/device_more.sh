#!/bin/bash
# The cells a second H200 session adds to a finished quality run (device_run.sh), in a new OUT folder on the
# same target (rebuilt bit-identically: run.py --stage target --expect-weights):
#   ours' data -> the peer's files and the workflow's verdict on them | ours, seed 2 (a third seed: the band)
#   all_ids' data (as soon as ours' regenerated rows exist) -> plant -> each planted mistake, seed 1
# summarize.py FIRST_RUN OUT prints the table with the cells of both.
# Usage: setsid nohup bash bench/quality/device_more.sh /tmp/q2 WEIGHTS_SHA256 > /tmp/q2/run.log 2>&1 &
. "$(dirname "$0")/device_common.sh" "$1"
train_serve() {  # variant seed: train, then serve the draft
  log "train $1 s$2"
  $R --stage train --variants "$1" --seeds "$2" > "$Q/train_$1_s$2.log" 2>&1
  $R --stage serve --only "$1_s$2" > "$Q/serve_$1_s$2.log" 2>&1
  log "done $1 s$2"
}

[ -f "$Q/target/target.json" ] || $R --stage target --expect-weights "$2" > "$Q/target.log" 2>&1 || { log "target failed"; exit 1; }
log "data ours"
$R --stage data --variants ours > "$Q/data_ours.log" 2>&1 &
ours=$!
regenerated=$Q/wd/ours/results/regenerated/conversations.jsonl  # written atomically by regenerate's merge
while [ ! -f "$regenerated" ] && kill -0 $ours 2>/dev/null; do sleep 5; done
log "data all_ids"
($R --stage data --variants all_ids > "$Q/data_all_ids.log" 2>&1 && $R --stage plant > "$Q/plant.log" 2>&1 &&
  for v in planted_layer_plus_one planted_post_norm_final planted_tokens_shifted; do train_serve $v 1 & done; wait) &
wait $ours || { log "ours' data failed"; wait; exit 1; }
log "ours' data done"
($R --stage peer > "$Q/peer.log" 2>&1; log "peer done") &
train_serve ours 2 &
wait
log "all done"
