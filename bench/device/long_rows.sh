#!/bin/bash
# Reasoning-length rows on the H200 (one GPU), as one background run after the vLLM payload (README.md here):
#   mkdir -p .old && git archive <commit before the fix> src config | tar -x -C .old   # here; carry .old
#   mkdir /tmp/repo && cp -r src bench config resources .old /tmp/repo && cd /tmp/repo   # there: a copy that
#   setsid nohup bash bench/device/long_rows.sh /tmp/lr > /tmp/lr.log 2>&1 &          # outlives the next call
# Each step's printout lands in OUT/<step>.txt (its command line first); OUT/done lists the steps and their rc.
#   before   the reproduction on the code before the logprob window (.old/src, 43994c8 for docs/runs/long_rows):
#            (b), the hooks path, on 4 rows of 20k-32k tokens: vLLM's engine died of CUDA OOM there
#   after    the same reproduction as reported: (a) plain prefill, (b) hooks, (f) built-in, 16 rows of 16k-32k
#   valid_*  bench/long_rows.py: capture and validation (logits check on) of 32k and 64k rows, 8B vocabulary and
#            Kimi-K2.5's vocabulary and hidden size, with a planted mistake
#   regress  the 393k-token uniform and mixed shards (192 x 2048), (a) and (b)
#   long64   8B shape, rows of 32k-64k; kimi64: the kimi-vocab shape, rows of 32k-64k
# STEPS="after valid_narrow" runs only those.
set -u
O=${1:?usage: long_rows.sh OUT}
mkdir -p "$O"
. /tmp/site/env.sh
NEW=$PWD/src:$PWD/bench
W=/tmp/lr-work
. "$(dirname "$0")/steps.sh"
step before "$PWD/.old/src:$PWD/bench" python3 bench/bench_extract.py $W/before --phases b --rows 4 --seq 32768 --min-len 20000 --max-len 32768
step after "$NEW" python3 bench/bench_extract.py $W/after --phases abf --rows 16 --seq 32768 --min-len 16384 --max-len 32768
step valid_narrow "$NEW" python3 bench/long_rows.py $W/valid --shape narrow --lengths 32768,65536,20000,4096
step valid_kimi "$NEW" python3 bench/long_rows.py $W/valid --shape kimi-vocab --lengths 32768,65536,20000,4096
step regress "$NEW" python3 bench/bench_extract.py $W/regress --phases ab --rows 192
step long64 "$NEW" python3 bench/bench_extract.py $W/long64 --phases ab --rows 4 --seq 65536 --min-len 32768 --max-len 65536
step kimi64 "$NEW" python3 bench/bench_extract.py $W/kimi64 --shape kimi-vocab --phases ab --rows 4 --seq 65536 --min-len 32768 --max-len 65536
echo "$(date +%T) all done" >> "$O/done"
