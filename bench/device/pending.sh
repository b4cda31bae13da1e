#!/bin/bash
# Every H200 measurement the open issues still wait for, in one background run on `nvidia-h200` (one GPU): the
# correctness cells first, then the timed steps one at a time on an idle GPU (earlier runs:
# docs/runs/h200_2026-12-0*_pending/):
#   issue 28 item 5   the image cells on both vLLM paths (passed on 2026-12-03 with the requests made on threads,
#                     and with them made in forked processes once each image was named on the request itself;
#                     docs/evidence.md); cheap, and they check the code the timed steps run
#   issue 28 item 7   bench_extract --images 4 (a Qwen2.5-VL-7B shape, image-heavy rows): (a), (b) hooks, (f) built-in.
#                     On 2026-12-03 b/a was 0.85-0.96 and f/a 0.90-0.98, the GPU idle 20-30 % of the timed
#                     seconds in all three phases; neither 8 threads, 4 x the tokens in flight nor 4 forked processes
#                     making the requests moved (b). What is left to see is which process paces it: top.txt samples
#                     every process's CPU every 2 s (the driver, vLLM's EngineCore, the GPU worker), beside
#                     gpu_util.txt (nvidia-smi dmon, timestamped; bench/gpu_util_summary.py gives each phase's
#                     busy share). 2026-12-03 (fourth session): py-spy found vLLM's engine-core thread pacing (a) and
#                     (b) alike, 36-55 % of it in vLLM's own concatenation of each step's pixel values (already
#                     bf16: casting them did nothing), and (b) also waiting on the V1 model runner's input-prep sync
#                     and on the prompt-logprob rows' copies. be28L measures (b) and (f) without those rows, 2 rounds
#                     (a b f a b f: the same code's rate moved 6-16 % from run to run); be28 one round with them.
#                     STEPS="be28L be28" skips the cells when src/ is unchanged since they last passed.
#                     2026-12-04: be28L got through round 1 (b/a 1.03 uniform, 0.87 mixed; f/a 0.98, 0.93) before the
#                     machine went between two calls (docs/evidence.md).
# After the vLLM payload (bench/device/README.md), from the project root:
#   setsid nohup bash bench/device/pending.sh /tmp/pend > /tmp/pend.log 2>&1 &
# Each step's log and results land in OUT/<step>/; OUT/done lists the steps that finished (rc per step). A step
# that fails does not stop the next. Bring back only the small files (a device call returns a few MiB):
#   cd OUT && find . -path '*/work' -prune -o -type f -size -400k -print | tar -czf $OUT/pend.tgz -T -
# To stop it from a later call, match patterns that do not match that call's own command line:
#   pkill -f "[p]ending\.sh"; pkill -f "[b]ench_extract\.py"
# STEPS="be28" runs only those steps (default: all, in the order below); ROWS sets the benches' --rows (default 256).
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
nvidia-smi dmon -s u -o T -d 1 > "$O/gpu_util.txt" 2>&1 &
DMON=$!
# each 2 s: the clock, then the processes over 20 % of a core (pid, user, ..., %CPU, %MEM, TIME+, command line)
top -b -d 2 -c -w 200 | awk '/^top -/ {print $3; fflush()} $1 ~ /^[0-9]+$/ && $9 + 0 > 20 {print; fflush()}' \
  > "$O/top.txt" 2>&1 &
TOP=$!
# py-spy (if installed: carry .whl/pyspy, `pip install --target /tmp/pyspy`), while the timed step runs: every 40 s,
# 15 s of each phase's processes' Python stacks (vLLM's EngineCore, whose one thread at TP 1 also runs the model and
# the hooks, and the phase's driver), without pausing them (--nonblocking), idle frames kept: which function holds
# the thread that paces a phase. bench/pyspy_summary.py OUT/pyspy reads them.
PYSPY=/tmp/pyspy/bin/py-spy
profile() {
  mkdir -p "$O/pyspy"
  while [ ! -e "$O/timed.end" ]; do
    drv=$(pgrep -f "[b]ench_extract.py .*--phase [a-z]" | head -1)
    if [ -n "$drv" ]; then
      ph=$(ps -o args= -p "$drv" | sed 's/.*--phase \([a-z]\).*/\1/')
      for pid in $drv $(pgrep -f "[V]LLM::EngineCore"); do
        who=$([ "$pid" = "$drv" ] && echo driver || echo core)
        PYTHONPATH=/tmp/pyspy timeout 30 "$PYSPY" record --nonblocking --idle --threads --rate 50 -d 15 --format raw \
          -p "$pid" -o "$O/pyspy/$(date +%H%M%S)_${ph}_${who}_$pid.txt" > /dev/null 2>> "$O/pyspy/errors.txt" &
      done
      wait
      gzip -9 -f "$O"/pyspy/[0-9]*.txt 2> /dev/null  # a window's raw stacks reach 400 KiB, the tar line's limit
    fi
    sleep 25
  done
}
keep() { mv "$O/$1/work/bench_extract.json" "$O/$1/" 2>/dev/null; rm -rf "$O/$1/work"; }  # the shards: up to 40 GB

# Correctness first: the image cells of both vLLM paths, side by side with a fixed KV cache each (--share-gpu).
cells=()
for path in hooks builtin; do
  step "vm28_$path" python3 bench/validation_matrix.py "$O/vm28_$path" --device cuda --tp 1 --families qwen2_5_vl \
    --backends vllm --capture-path "$path" --dump --share-gpu &
  cells+=($!)
done
wait "${cells[@]}"  # not a bare wait: dmon runs in the background to the end

# Timed: nothing else on the GPU.
B="python3 bench/bench_extract.py"
[ -x "$PYSPY" ] && { profile & PROF=$!; }
# be28L first: (b) and (f) without the 4 rows a shard whose prompt logprobs vLLM returns. Each such row's copy back
# syncs the engine core's step (6-10.5 % of its thread's samples in (b), py-spy 2026-12-03), which (a) never pays;
# a shard the plan sizes (engine start under 5 % of the job: thousands of rows) has the same 4 rows, so the
# 256-row bench charges them many times over. Two rounds (a b f a b f), each ratio against its own round's (a):
# one engine's rate moved 6-16 % run to run.
step be28L $B "$O/be28L/work" --images 4 --phases abf --rounds 2 --rows "${ROWS:-256}" --logprob-rows 0
keep be28L
# Then one round with the config's 4 logprob rows, the same session's comparison.
step be28 $B "$O/be28/work" --images 4 --phases abf --rounds "${ROUNDS:-1}" --rows "${ROWS:-256}"
keep be28
touch "$O/timed.end"; [ -n "${PROF:-}" ] && wait "$PROF"
kill $DMON $TOP 2>/dev/null
log "all done"
