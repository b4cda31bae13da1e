#!/bin/bash
# Every H200 measurement the open issues wait for, in one background run on `nvidia-h200` (one GPU), so a device
# session spends its time measuring: the correctness cells side by side, then the timed benches one at a time on an
# idle GPU.
#   issue 25 item 2   bench_extract abfg on the 8B shape (hooks, built-in, built-in FP8 against plain prefill)
#   issue 26 item 5   the same run's b/a (the hooks path after the restructuring; earlier b/a: docs/performance.md)
#   issue 25 item 3   moe-prefill on the DeepSeek-V3 shape at TP 1: plain, hooks, built-in
#   issue 28 item 7   bench_extract --images 4 (a Qwen2.5-VL-7B shape, image-heavy rows) abf
#   issue 25 item 3   validation matrix, kimi_int4, hooks and built-in
#   issue 28 item 5   validation matrix, qwen2_5_vl (images), hf + hooks, then built-in
# After the vLLM payload (bench/device/README.md), from the project root:
#   setsid nohup bash bench/device/pending.sh /tmp/pend > /tmp/pend.log 2>&1 &
# Each step's log and results land in OUT/<step>/; OUT/done lists the steps that finished (rc per step). A step
# that fails does not stop the next. `tar -C OUT -czf $OUT/pend.tgz .` brings it all back; docs/runs/ keeps it.
# STEPS="be25 mgm25" runs only those steps (default: all, in the order below).
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

# Correctness first: the validation matrix cells (every row, then the planted mistakes), all four at once with a
# fixed 2 GiB KV cache each (--share-gpu); they are not timed, and a session that runs out of device time keeps them.
for path in hooks builtin; do
  step "vk25_$path" python3 bench/validation_matrix.py "$O/vk25_$path" --device cuda --tp 1 --backends vllm \
    --families kimi_int4 --dtypes bfloat16 --capture-path "$path" --dump --share-gpu &
done
step vm28_hooks python3 bench/validation_matrix.py "$O/vm28_hooks" --device cuda --tp 1 --families qwen2_5_vl \
  --backends hf vllm --capture-path hooks --dump --share-gpu &
step vm28_builtin python3 bench/validation_matrix.py "$O/vm28_builtin" --device cuda --tp 1 --families qwen2_5_vl \
  --backends vllm --capture-path builtin --dump --share-gpu &
wait

# Timed: one at a time, nothing else on the GPU.
step be25 python3 bench/bench_extract.py "$O/be25/work" --phases abfg --rows 192
keep() { mv "$O/$1/work/bench_extract.json" "$O/$1/" 2>/dev/null; rm -rf "$O/$1/work"; }  # the shards: ~13 GB each
keep be25
step mgm25 python3 bench/multi_gpu.py moe-prefill "$O/mgm25" --tp 1 --layers 4 --phases abf --capture-path hooks
step be28 python3 bench/bench_extract.py "$O/be28/work" --images 4 --phases abf --rows 256
keep be28
log "all done"
