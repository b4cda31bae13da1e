"""Which planted mistakes the overfit gate catches, on the demo target.

    .venv-vllm/bin/python bench/overfit_gate.py OUT [--dtype float32] [--cases correct layer_plus_one ...]

Builds the demo workflow's tokenized rows (`snakemake results/tokenized`, the demo model, one shard) in
OUT/wd, then runs the gate (eagle3prep.overfit_gate.stage.run_overfit_gate_job, its default settings: 4 prompts,
32 served tokens each, k = 3, greedy) once per case, each case in OUT/<case>/:
- correct: the run's layer ids captured as they are;
- layer_plus_one / layer_minus_one: every auxiliary id k holds id k +/- 1 in the data, while the draft's
  config keeps the right ids (the export's target_layer_ids): a careless pipeline's off-by-one;
- post_norm_final: id N holds the final norm's output instead of its input (transformers'
  output_hidden_states[N] taken for the pre-norm state);
- tokens_shifted: every row's states one token early against its ids.
Planted with testkit.planted.plant on the gate's own shard, captured for this with every id 0..N. The
trainer runs in EAGLE3PREP_TRAIN_PYTHON (default .venv/bin/python, which has speculators). Prints one line
per case and writes OUT/summary.json; docs/runs/acceptance/overfit_gate/ holds a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test kit, tests/testkit
CASES = ("correct", "layer_plus_one", "layer_minus_one", "post_norm_final", "tokens_shifted")


def tokenized_rows(wd: Path, dtype: str) -> Path:
    """The demo's tokenized rows (one shard), made by the workflow itself."""
    import yaml

    (wd / "config").mkdir(parents=True, exist_ok=True)
    if not (wd / "resources").exists():
        (wd / "resources").symlink_to(REPO / "resources")
    cfg = {
        "data": {"sources": ["resources/demo/sharegpt.jsonl"]},
        "model": {"path": "results/demo/model", "build_demo": True},
        "tokenize": {"max_seq_len": 128, "num_shards": 1},
        "extract": {"dtype": dtype},
    }
    (wd / "config/config.yaml").write_text(yaml.safe_dump(cfg))
    snakemake = Path(sys.executable).with_name("snakemake")
    cmd = [str(snakemake), "--snakefile", str(REPO / "Snakefile"), "--cores", "2", "results/tokenized"]
    subprocess.run(cmd, cwd=wd, check=True, capture_output=True)
    return wd / "results/tokenized/shard_0.jsonl"


def planter(case: str, model: Path, ids: list[int]):
    """The `plant` callback of run_overfit_gate_job for `case` (None for correct)."""
    if case == "correct":
        return None
    from testkit.planted import plant

    def final_norm(x):
        import torch
        from transformers import AutoModelForCausalLM

        norm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).get_decoder().norm
        with torch.no_grad():
            return norm(x.float())

    def run(shard: Path) -> Path:
        return plant(case, shard, shard.with_name(f"{shard.name}_{case}"), ids, final_norm)

    return run


def run_case(case: str, tokenized: Path, model: Path, out: Path, dtype: str) -> dict:
    from eagle3prep.errors import UserError
    from eagle3prep.layers import default_layer_ids
    from eagle3prep.model_facts import ModelFacts
    from eagle3prep.overfit_gate.stage import OverfitGateJobSettings, OverfitGatePaths, run_overfit_gate_job
    from eagle3prep.settings import ExtractSettings, LayersSettings, RegenerateSettings

    n = ModelFacts.read(str(model)).num_hidden_layers
    ids = sorted(set(default_layer_ids(n)))
    # A planted case captures every id, so that plant() can borrow id k +/- 1, and keeps the run's ids.
    layers = LayersSettings.defaults(ids=ids if case == "correct" else list(range(n + 1)))
    extract = ExtractSettings.defaults(
        backend="hf", device="cpu", dtype=dtype, batch_tokens=4096, tp_size=1, threads=2
    )
    regenerate = RegenerateSettings.defaults(dtype=dtype, enforce_eager=True, tp_size=1)
    t0 = time.time()
    try:
        run_overfit_gate_job(
            OverfitGatePaths(str(tokenized), str(out / "gate.json"), str(out), str(model)),
            OverfitGateJobSettings(layers, extract, regenerate, {}, trust_remote_code=False, threads=2,
                                   plant=planter(case, model, ids)),
        )  # fmt: skip
    except UserError as e:
        print(f"[bench] {case}: {e}", file=sys.stderr)
    record = json.loads((out / "overfit_gate.json").read_text())
    acc = record["acceptance"]
    return {
        "case": case,
        "verdict": record["verdict"],
        "mean_acceptance_length": acc["mean_acceptance_length"],
        "acceptance_per_position": acc["acceptance_per_position"],
        "drafts": acc["drafts"],
        "accepted": acc["accepted"],
        "accepted_per_position": acc["accepted_per_position"],
        "all_prompts": record["acceptance_all_prompts"],
        "served_equal_to_regenerated": record["served_equal_to_regenerated"],
        "train_loss_last": record["training"]["loss_last"],
        "train_full_acc_last": record["training"]["train_full_acc_last"],
        "wall_s": round(time.time() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="float32", help="engines and capture (bfloat16: near-ties of the random model)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    opts = ap.parse_args(argv)
    os.environ.setdefault("EAGLE3PREP_TRAIN_PYTHON", str(REPO / ".venv/bin/python"))
    # One engine process per start (the engine core in this process): ~20 s less per start on 2 cores.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    opts.out.mkdir(parents=True, exist_ok=True)
    tokenized = tokenized_rows(opts.out / "wd", opts.dtype)
    model = (opts.out / "wd/results/demo/model").resolve()
    results = []
    for case in opts.cases:
        r = run_case(case, tokenized, model, opts.out / case, opts.dtype)
        results.append(r)
        print(
            f"{case:16s} {r['verdict']:5s} mean acceptance length {r['mean_acceptance_length']:.3f}, per position "
            f"{r['acceptance_per_position']} ({r['accepted']}/{r['drafts'] * len(r['accepted_per_position'])} drafted tokens, "
            f"{r['served_equal_to_regenerated']} prompts judged), train loss {r['train_loss_last']:.4f}",
            flush=True,
        )
    summary = {"dtype": opts.dtype, "cases": results}
    (opts.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
