#!/bin/bash
# The newest vLLM (the 0.34.0 payload, README.md here) on the H200 (one GPU), as one background run:
#   mkdir /tmp/repo && tar --exclude=./.whl --exclude=./docs -cf - . | tar -xf - -C /tmp/repo && cd /tmp/repo
#   setsid nohup bash bench/device/newest_vllm.sh /tmp/nv > /tmp/nv.log 2>&1 &
# Each step's printout lands in OUT/<step>.txt (its command line first); OUT/done lists the steps and their rc.
#   matrix    the validation matrix's vLLM cells, bf16, the path auto picks, five families at once on the shared
#             GPU: llama, qwen3_moe, deepseek_v3 (MLA), kimi_int4 (INT4 routed experts), qwen2_5_vl (images);
#             each family's table in OUT/matrix_<family>.txt
#   workflow  the workflow's GPU rule through snakemake (gpu_validate.py; needs the tools payload): Llama and
#             the Kimi-shaped INT4 target
#   valid_narrow / valid_kimi  capture and validation (logits check on) of 4k-64k rows, the 8B vocabulary on a
#             narrow body / the kimi-vocab shape, then a planted mistake (kimi: layer ids 1, 2: the built-in path
#             refuses id 0); rows past one 16,384-token step are handed out in parts as they prefill
#   long64    8B shape, rows of 32k-64k; kimi64: the kimi-vocab shape, the same rows
#   regress   the 393k-token uniform and mixed shards (192 x 2048)
#   kimi_int4 the Kimi-shaped INT4 target
#             (bench_extract phases: (p) plain prefill compiled as vLLM starts by default, (e) vLLM's
#             extract_hidden_states with nothing saved (its own cost), (f) the built-in path compiled: auto's path
#             on 0.34, with the default enforce_eager: false)
#   regen_long  the regenerate stage writing replies of up to 24k tokens (8B shape), beside plain generate;
#             random weights rarely stop early: each phase is ~24,000 decode steps (8 prompts: the step time, not
#             the prompt count, sets it)
#   quality   the acceptance bench's ours and peer branches (bench/quality/device_run.sh; needs the tools payload),
#             its summary in OUT/quality.txt
# Steps run in this order; STEPS="quality regress" runs only those; REGRESS_PHASES=pf drops (e) from regress;
# MATRIX_FAMILIES="qwen2_5_vl" only that
# family's matrix.
set -u
O=${1:?usage: newest_vllm.sh OUT}
mkdir -p "$O"
. /tmp/site/env.sh
[ -f /tmp/tools/env.sh ] && . /tmp/tools/env.sh
NEW=$PWD/src:$PWD/bench
W=/tmp/nv-work
. "$(dirname "$0")/steps.sh"
matrix() {  # one process per family: each engine with a fixed 2 GiB KV cache (--share-gpu)
  local f pids=() rc=0
  for f in ${MATRIX_FAMILIES:-llama qwen3_moe deepseek_v3 kimi_int4 qwen2_5_vl}; do
    python3 bench/validation_matrix.py "$W/matrix/$f" --families $f --backends vllm --dtypes bfloat16 \
      --device cuda --share-gpu > "$O/matrix_$f.txt" 2>&1 &
    pids+=($!)
  done
  for f in "${pids[@]}"; do wait "$f" || rc=1; done
  return $rc
}
workflow() {
  python3 bench/gpu_validate.py "$W/workflow/llama" --runs 1:auto && \
    python3 bench/gpu_validate.py "$W/workflow/kimi" --target kimi-int4 --runs 1:auto
}
quality() {
  BRANCHES="ours peer" bash bench/quality/device_run.sh "$W/q" > "$O/quality_run.log" 2>&1
  python3 bench/quality/summarize.py "$W/q"
}
step matrix "$NEW" matrix
step workflow "$NEW" workflow
step valid_narrow "$NEW" python3 bench/long_rows.py $W/valid_narrow --shape narrow --lengths 32768,65536,20000,4096
step long64 "$NEW" python3 bench/bench_extract.py $W/long64 --phases pef --rows 4 --seq 65536 --min-len 32768 --max-len 65536
step regress "$NEW" python3 bench/bench_extract.py $W/regress --phases ${REGRESS_PHASES:-pef} --rows 192
step kimi_int4 "$NEW" python3 bench/bench_extract.py $W/kimi_int4 --shape kimi-int4 --phases pf --rows 384 --seq 1000 --min-len 100 --max-len 1000
step regen_long "$NEW" python3 bench/bench_regenerate.py $W/regen_long --prompts 8 --max-tokens 24000 --max-model-len 32768 --rounds 1
step quality "$NEW" quality
step valid_kimi "$NEW" python3 bench/long_rows.py $W/valid_kimi --shape kimi-vocab --lengths 32768,65536,20000,4096 --layer-ids 1,2
step kimi64 "$NEW" python3 bench/bench_extract.py $W/kimi64 --shape kimi-vocab --phases pf --rows 4 --seq 65536 --min-len 32768 --max-len 65536
echo "$(date +%T) all done" >> "$O/done"
