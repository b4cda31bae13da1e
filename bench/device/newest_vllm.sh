#!/bin/bash
# The newest vLLM (the 0.34.0 payload, README.md here) on the H200 (one GPU), as one background run:
#   mkdir /tmp/repo && tar --exclude=./.whl --exclude=./docs -cf - . | tar -xf - -C /tmp/repo && cd /tmp/repo
#   setsid nohup bash bench/device/newest_vllm.sh /tmp/nv > /tmp/nv.log 2>&1 &
# polled at once from the same message, call after call: bash bench/device/poll.sh /tmp/nv (README.md, "Long runs")
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
#   regen_long  the regenerate stage writing replies of up to 16k tokens (8B shape), beside plain generate;
#             random weights rarely stop early: each phase is ~16,400 decode steps (8 prompts: the step time, not
#             the prompt count, sets it)
#   thinking_mx  thinking-length rows end to end through snakemake (gpu_validate.py --thinking): the regenerate
#             stage writes 24,000-token replies with a small random Llama whose stop tokens never win, then those rows
#             are captured in MXFP4 and validated against transformers (needs the tools payload)
#   fmt_8b / fmt_kimi / fmt_real  bench/storage_formats.py: bytes, per-layer error, encode and decode cost of each
#             storage format on random 8B- and Kimi-shaped layers, and on the quality target's own shard (after quality_mx)
#   fmt_kernel_8b / fmt_kernel_kimi  the encode kernels (shard/kernels.py) beside the torch reference: GB/s of bf16 in
#             on 65,536 rows at hidden 4,096 / 7,168, and the byte-identity check of the two (PASS / FAIL lines)
#   train_mx  the trainer (eagle3prep-train, direct backend) on bf16 and MXFP4 shards of the same rows of a random
#             4,096-wide target: median step time of each and their ratio (bench/train_formats.py; needs the tools
#             payload's speculators and, for the config schema, the vLLM payload's jsonschema: run it after the install)
#   regress_mx / kimi64_mx  regress / kimi64 with (g) writing MXFP4 beside (f) in bf16 and (p), on the local disk
#   shm_f     (p) and (f) in bf16 with the shard in /dev/shm: the path's own cost apart from the disk
#   quality_mx  the acceptance bench with ours (bf16), fp8 and mxfp4 drafts from the same rows, two seeds each
#   images    the image-heavy workload on auto's path beside plain compiled prefill
#   kimi_int4_mx  the Kimi-shaped INT4 MoE target with (g) writing MXFP4 beside plain compiled prefill (p)
#   faults    the GPU fault matrix through snakemake (bench/gpu_faults.py; needs the tools payload): out of memory at
#             engine start and mid-shard, the engine core killed, a full disk mid-shard, SIGTERM; each one line,
#             finished shards kept, one rerun completes
#   quality   the acceptance bench's ours and peer branches (bench/quality/device_run.sh; needs the tools payload),
#             its summary in OUT/quality.txt
#   quality_drafts  each draft type (eagle3 peagle dflash dspark mtp; QDRAFTS picks) trained on ours (bf16), mxfp4 and
#             the peer's rows, two seeds, served where this vLLM serves the type; summarize.py's table and verdict
#             per type in OUT/quality_drafts.txt. speculators 0.9 trains mtp on qwen3-family targets only, so on this
#             Llama target its trainer refuses in seconds and the printout says so. About 16 GPU minutes, estimated
#             (not measured) from the H200 quality run (docs/runs/acceptance/summary.txt): the target 71 s, ours'
#             data 256 s, then beside it mxfp4's (fp8's 156 s) and the peer; each branch trains its 10 (type, seed)
#             drafts at once, a process each (mtp's 2 refused in seconds), at ~2x that run's ~160 s (eagle3 beside
#             ~9 trainers; here up to ~24 share the GPU and 16 cores; every type at one draft layer) = ~320 s, and
#             serves each draft once trained, 8 engines at once over all branches (device_run.sh SERVE_SLOTS): the
#             last two branches' 16 serves in two waves at ~90 s (that run's engine starts beside others: 58-105 s)
#             = ~180 s: 71 + 256 + 156 + 320 + 180 = ~980 s
# Steps run in the order STEPS gives (default: ALL below), a+b both at once (faults+thinking_mx: neither is timed);
# REGRESS_PHASES=pf drops (e) from regress; FAULTS="a b"
# only those rows of the fault matrix, FAULTS_PARALLEL=1 each in a workdir of its own, all at once;
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
quality() {  # QDIR: the run folder (fmt_real reads $W/q); DRAFTS reaches run.py through device_common.sh
  local q=${QDIR:-$W/q} p=$O/${QDIR:+$(basename "$QDIR")_}
  BRANCHES="${QBRANCHES:-ours peer}" bash bench/quality/device_run.sh "$q" > "${p}quality_run.log" 2>&1
  cp "$q/gpu_memory.log" "${p}gpu_memory.log"  # the step removes its run folder (QDIR)
  python3 bench/quality/summarize.py "$q"
}
images() {  # the image-heavy workload on auto's path (built-in on 0.34) beside plain compiled prefill
  python3 bench/bench_extract.py "$W/images" --images 4 --phases pf --rows 64
}
ALL="matrix workflow valid_narrow long64 regress kimi_int4 regen_long thinking_mx quality valid_kimi kimi64 fmt_8b fmt_kimi
  regress_mx quality_mx fmt_real kimi64_mx shm_f images kimi_int4_mx faults fmt_kernel_8b fmt_kernel_kimi train_mx
  quality_drafts"
# STEPS=seed: what the seed's workload still needs on the GPU, in order of importance: the fault rows not yet run
# since their fixes beside the thinking-length rows end to end, the trainer on MXFP4, the Kimi shapes and the 8B
# shards in MXFP4 against plain prefill, 16k-token replies, the image rows. About 30 minutes after the install,
# estimated from these steps' earlier records (docs/runs/vllm_range/vllm_0.34/steps_*.txt), not measured whole:
# a device budget that ends first cuts the last steps.
SEED="faults+thinking_mx train_mx kimi64_mx kimi_int4_mx regress_mx regen_long images"
if [ "${STEPS:-}" = seed ]; then
  STEPS=$SEED FAULTS=${FAULTS:-oom_mid engine_kill} FAULTS_PARALLEL=1 MX_PHASES=${MX_PHASES:-pg}
fi
run_step() {
  case $1 in
    matrix) step matrix "$NEW" matrix ;;
    workflow) step workflow "$NEW" workflow ;;
    valid_narrow) step valid_narrow "$NEW" python3 bench/long_rows.py $W/valid_narrow --shape narrow --lengths 32768,65536,20000,4096 ;;
    long64) step long64 "$NEW" python3 bench/bench_extract.py $W/long64 --phases pef --rows 4 --seq 65536 --min-len 32768 --max-len 65536 ;;
    regress) step regress "$NEW" python3 bench/bench_extract.py $W/regress --phases ${REGRESS_PHASES:-pef} --rows 192 ;;
    kimi_int4) step kimi_int4 "$NEW" python3 bench/bench_extract.py $W/kimi_int4 --shape kimi-int4 --phases pf --rows 384 --seq 1000 --min-len 100 --max-len 1000 ;;
    regen_long) step regen_long "$NEW" python3 bench/bench_regenerate.py $W/regen_long --prompts 8 --max-tokens 16384 --max-model-len 32768 --rounds 1 ;;
    thinking_mx) step thinking_mx "$NEW" python3 bench/gpu_validate.py $W/thinking --runs 1:auto --thinking 24000 --kv-gib 16 ;;
    quality) step quality "$NEW" quality ;;
    valid_kimi) step valid_kimi "$NEW" python3 bench/long_rows.py $W/valid_kimi --shape kimi-vocab --lengths 32768,65536,20000,4096 --layer-ids 1,2 ;;
    kimi64) step kimi64 "$NEW" python3 bench/bench_extract.py $W/kimi64 --shape kimi-vocab --phases pf --rows 4 --seq 65536 --min-len 32768 --max-len 65536 ;;
    # storage formats: the error table on random 8B- and Kimi-shaped layers, then on the quality target's own shard
    fmt_8b) step fmt_8b "$NEW" python3 bench/storage_formats.py --shape llama-8b --tokens 8192 ;;
    fmt_kimi) step fmt_kimi "$NEW" python3 bench/storage_formats.py --shape kimi --tokens 8192 ;;
    fmt_real) step fmt_real "$NEW" python3 bench/storage_formats.py --shard $W/q/wd/ours/results/hidden_states/shard_0 --tokens 65536 ;;
    # the encode kernels beside the reference (GB/s, byte identity), and the trainer's pace on MXFP4 shards
    fmt_kernel_8b) step fmt_kernel_8b "$NEW" python3 bench/storage_formats.py --shape llama-8b --tokens 8192 --encode-tokens 65536 ;;
    fmt_kernel_kimi) step fmt_kernel_kimi "$NEW" python3 bench/storage_formats.py --shape kimi --tokens 8192 --encode-tokens 65536 ;;
    train_mx) step train_mx "$NEW" python3 bench/train_formats.py $W/train_mx --hidden 4096 --rows 40 --seq 4096 --steps 30 --workers 8 ;;
    # capture speed with (g) writing MXFP4 beside (f) in bf16 and plain compiled prefill (p), on the local disk
    regress_mx) step regress_mx "$NEW" python3 bench/bench_extract.py $W/regress_mx --phases ${MX_PHASES:-pfg} --scaled mxfp4 --rows 192 ;;
    kimi64_mx) step kimi64_mx "$NEW" python3 bench/bench_extract.py $W/kimi64_mx --shape kimi-vocab --phases ${MX_PHASES:-pfg} --scaled mxfp4 --rows 4 --seq 65536 --min-len 32768 --max-len 65536 ;;
    shm_f) step shm_f "$NEW" python3 bench/bench_extract.py /dev/shm/e3p_shm_f --phases pf --rows 192 ;;
    # the acceptance bench: ours (bf16), fp8 and mxfp4 drafts from the same rows, two seeds each
    quality_mx) QBRANCHES="${QMX_BRANCHES:-ours fp8 mxfp4}" step quality_mx "$NEW" quality ;;
    # each draft type from ours (bf16), mxfp4 and the peer's rows, two seeds (its run folder removed after the step)
    quality_drafts) QBRANCHES="ours mxfp4 peer" DRAFTS="${QDRAFTS:-eagle3 peagle dflash dspark mtp}" QDIR=$W/quality_drafts \
      step quality_drafts "$NEW" quality ;;
    images) step images "$NEW" images ;;
    kimi_int4_mx) step kimi_int4_mx "$NEW" python3 bench/bench_extract.py $W/kimi_int4_mx --shape kimi-int4 --phases ${MX_PHASES:-pfg} --scaled mxfp4 --rows 384 --seq 1000 --min-len 100 --max-len 1000 ;;
    faults) step faults "$NEW" python3 bench/gpu_faults.py $W/faults ${FAULTS:+--faults $FAULTS} ${FAULTS_PARALLEL:+--parallel} ;;
    *) echo "$(date +%T) no step $1 (of $ALL)" >> "$O/done" ;;
  esac
}
for s in ${STEPS:-$ALL}; do  # a+b runs the two at once (correctness steps only: they share the GPU)
  for part in ${s//+/ }; do run_step "$part" & done
  wait
done
echo "$(date +%T) all done" >> "$O/done"
