#!/usr/bin/env bash
# docs/guides/training.md's CPU recipe on the whole demo, as a user runs it from a checkout: the demo
# workflow with the direct export, then the guide's `eagle3prep-train --cpu` command (read from the guide,
# so the two cannot drift apart) for one epoch. Prints the wall time of each and speculators' losses.
# Usage: bash bench/train_cpu_demo.sh WORKDIR   (VENV: the .venv to use; printout: docs/runs/training/cpu_demo.txt)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$repo/.venv}
wd=$1
mkdir -p "$wd/config"
cd "$wd"
ln -sfn "$repo/resources" resources
cp "$repo/config/config.yaml" config/config.yaml
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
echo "host: $(nproc) cores, $(uname -m); $("$venv/bin/python" -c 'import torch, importlib.metadata as m; print("torch", torch.__version__, "speculators", m.version("speculators"))')"

t0=$(date +%s)
"$venv/bin/snakemake" --snakefile "$repo/Snakefile" --cores all --config 'export={speculators: true, hidden_states: direct}' \
    >snakemake.log 2>&1
t1=$(date +%s)
rows=$("$venv/bin/python" -c 'import json; print(json.load(open("results/export/speculators/manifest.json"))["rows"])')
echo "snakemake (the demo, export.hidden_states direct): $((t1 - t0)) s, $rows rows exported"

# The guide's CPU command: the ```bash block line that starts `.venv/bin/eagle3prep-train --cpu`, continuations joined.
cmd=$("$venv/bin/python" - "$repo/docs/guides/training.md" <<'PY'
import re, shlex, sys
for block in re.findall(r"```bash\n(.*?)```", open(sys.argv[1]).read(), re.S):
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0].endswith("/eagle3prep-train") and "--cpu" in words:
            print(shlex.join(words[1:]))
PY
)
echo "eagle3prep-train $cmd"
rm -rf checkpoints/demo-eagle3
t2=$(date +%s)
eval "\"$venv/bin/python\" -m eagle3prep.train $cmd" >train.log 2>&1
t3=$(date +%s)
echo "eagle3prep-train --cpu, one epoch: $((t3 - t2)) s (imports included)"
"$venv/bin/python" - <<'PY'
import json
rows = [json.loads(line) for line in open("checkpoints/demo-eagle3/metrics.jsonl")]
train = [r["train"]["loss"] for r in rows if "train" in r]
val = [r["val"]["loss_epoch"] for r in rows if "val" in r]
cfg = json.load(open("checkpoints/demo-eagle3/0/config.json"))
print(f"{len(train)} steps, loss {train[0]:.3f} -> {train[-1]:.3f}; validation loss {val[-1]:.3f};",
      f"draft checkpoints/demo-eagle3/0, eagle_aux_hidden_state_layer_ids {cfg['eagle_aux_hidden_state_layer_ids']}")
PY
