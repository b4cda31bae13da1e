# Sourced by device_run.sh and device_more.sh with the run folder as $1: the device's vLLM and tools, the
# bench's command ($R) and a timestamped log line.
set -u
Q=$1
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
. /tmp/site/env.sh && . /tmp/tools/env.sh
# DRAFTS="eagle3 dflash ...": every stage gets --drafts (the data stage captures their union)
R="python3 bench/quality/run.py $Q${DRAFTS:+ --drafts $DRAFTS}"
log() { echo "$(date +%T) $*"; }
