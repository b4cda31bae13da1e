#!/bin/bash
# Every H200 measurement the open issues still wait for, in one background run on `nvidia-h200` (one GPU): the
# correctness cells first, then the timed steps one at a time on an idle GPU (the runs of 2026-12-02 did the rest:
# docs/runs/h200_2026-12-02_pending/ and docs/runs/h200_2026-12-02b_pending/):
#   issue 28 item 5   the image cells on both vLLM paths again: the driver now makes a row's whole request (its images
#                     loaded, vLLM's input processor run) on a thread pool ahead of the submission loop, with vLLM's
#                     processor cache off (backends/vllm/paths.py, compat.request_maker)
#   issue 28 item 7   bench_extract --images 4 (a Qwen2.5-VL-7B shape, image-heavy rows): (a), (b) hooks, (f) built-in;
#                     before, with the driver's one thread running the processor, b/a was 0.70 / 0.80 and f/a
#                     0.80 / 0.74 (docs/performance.md); the driver's seconds and uniform_again now say where time goes
# After the vLLM payload (bench/device/README.md), from the project root:
#   setsid nohup bash bench/device/pending.sh /tmp/pend > /tmp/pend.log 2>&1 &
# Each step's log and results land in OUT/<step>/; OUT/done lists the steps that finished (rc per step). A step
# that fails does not stop the next. Bring back only the small files (a device call returns a few MiB):
#   cd OUT && find . -path '*/work' -prune -o -type f -size -400k -print | tar -czf $OUT/pend.tgz -T -
# To stop it from a later call, match patterns that do not match that call's own command line:
#   pkill -f "[p]ending\.sh"; pkill -f "[b]ench_extract\.py"
# STEPS="be28" runs only those steps (default: all, in the order below); ROWS sets be28's --rows (default 256).
set -u
O=${1:?usage: pending.sh OUT}
mkdir -p "$O"
. /tmp/site/env.sh
export PYTHONPATH=$PWD/src:$PWD/bench:${PYTHONPATH:-}
log() { echo "$(date +%T) $*" | tee -a "$O/done"; }
step() {  # name command...: run one step into OUT/name, its output in OUT/name/log
  local name=$1; shift
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return ;; esac
  mkdir -p "$O/$name"
  log "start $name: $*"
  "$@" > "$O/$name/log" 2>&1
  log "end $name rc $?"
}
python3 -c "import torchvision; from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil" \
  > "$O/vision_imports.txt" 2>&1 && log "vision imports ok" || log "vision imports FAIL (the image steps will fail)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$O/gpu.txt" 2>&1
keep() { mv "$O/$1/work/bench_extract.json" "$O/$1/" 2>/dev/null; rm -rf "$O/$1/work"; }  # the shards: up to 40 GB

# Correctness first: the image cells of both vLLM paths, side by side with a fixed KV cache each (--share-gpu).
for path in hooks builtin; do
  step "vm28_$path" python3 bench/validation_matrix.py "$O/vm28_$path" --device cuda --tp 1 --families qwen2_5_vl \
    --backends vllm --capture-path "$path" --dump --share-gpu &
done
wait

# Timed: nothing else on the GPU.
step be28 python3 bench/bench_extract.py "$O/be28/work" --images 4 --phases abf --rows "${ROWS:-256}"
keep be28
log "all done"
