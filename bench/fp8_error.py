"""What FP8 storage (extract.storage: fp8_e4m3) costs in bytes and in error, on the CPU.

    python bench/fp8_error.py OUT [--models demo llama qwen3_moe deepseek_v3] [--rows 8]

For each model (the demo Llama of eagle3prep.demo, tiny random families of eagle3prep.testing.tiny_models) it
captures the same synthetic rows twice through extract_shard with the hf backend in bf16, once stored as
bf16 and once as FP8, at the default ids [2, N//2, N-3, N], and recomputes them in fp32 with
transformers (reference.Reference). Per layer id, over every token (per-token relative error
|x - y| / |y|, mean / p99 / max, and the lowest cosine):

  bf16 vs fp32        what bf16 capture already costs (the floor the pass rule starts from)
  store bf16 / fp8    storage alone, on the exact fp32 state: rounded to bf16, or through FP8 and back
  fp8 vs bf16         FP8 storage alone: our layer files (one scale per token and layer)
  fp8 vs fp32         both together: what validate judges
  joint vs bf16       speculators' own connector: one scale per token over all layers ([T, L, H])
  export vs bf16      the FP8 shard requantized jointly ([T, 1, 1] scales, their connector's layout),
                      dequantized their way (fp8.to(bf16) * scale.to(bf16)): what an export in that
                      layout would cost. Our export keeps the shards' per-layer scales ([T, L, 1]), so
                      what speculators reads from it is "fp8 vs bf16" plus bf16 rounding.

The "grown" lines repeat joint and per-layer storage after scaling the layer slots by 1, 4, 16, 64
(synthetic: a residual stream that grows with depth, as trained models' do); the tiny random models
here do not grow. Writes OUT/fp8_error.json and prints the table (docs/runs/fp8/ holds a run).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

from eagle3prep.backends.base import CaptureSpec
from eagle3prep.demo import build_demo_model
from eagle3prep.extract import extract_shard
from eagle3prep.layers import default_layer_ids
from eagle3prep.settings import ExtractSettings
from eagle3prep.shard.fp8 import quantize_fp8, roundtrip_fp8
from eagle3prep.shard.layout import layer_file, token_bytes
from eagle3prep.shard.readers import read_layer
from eagle3prep.testing.tiny_models import FAMILIES, build_family
from eagle3prep.validate.reference import Reference

REPO = Path(__file__).resolve().parents[1]
GROWTH = (1.0, 4.0, 16.0, 64.0)  # synthetic per-slot scale for the "grown" lines


def write_rows(path: Path, rows: int, vocab: int, seed: int) -> Path:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            n = rng.randint(32, 200)
            ids = [rng.randrange(5, vocab) for _ in range(n)]
            f.write(json.dumps({"row": i, "id": f"r{i}", "input_ids": ids, "loss_mask": [1] * n, "seq_len": n}) + "\n")
    return path


def stats(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Per-token relative error of x against y ([T, H]): mean, p99, max; and the lowest cosine."""
    x, y = x.float(), y.float()
    e = (x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-30)
    cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
    return {
        "mean": float(e.mean()),
        "p99": float(e.quantile(0.99)),
        "max": float(e.max()),
        "min_cos": float(cos.min()),
    }


def speculators_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """hs_connectors.fp8_utils.dequantize_fp8_tensor: the product in bf16."""
    return q.to(torch.bfloat16) * s.to(torch.bfloat16)


def joint(stack: torch.Tensor) -> torch.Tensor:
    """[T, L, H] through one scale per token (speculators' layout), read back their way."""
    return speculators_dequant(*quantize_fp8(stack))


def run_model(name: str, out: Path, rows: int) -> dict:
    wd = out / name
    if name == "demo":
        model = build_demo_model(wd / "model", REPO / "resources/demo/tokenizer_corpus.txt")
    else:
        model = build_family(name, wd / "model")
    config = json.loads((model / "config.json").read_text())
    n, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config.get("vocab_size", 512)
    ids = sorted(set(default_layer_ids(n)))
    tokens = write_rows(wd / "tokens.jsonl", rows, vocab, 0)
    spec = CaptureSpec(
        backend="hf", model_path=str(model), layer_ids=ids, dtype="bfloat16", max_seq_len=256, device="cpu", tp_size=1
    )
    shards = {}
    for storage in ("model_dtype", "fp8_e4m3"):
        t0 = time.time()
        extract_shard(
            str(tokens), str(wd / storage), spec, ExtractSettings.defaults(storage=storage, batch_tokens=2048), shard=0
        )
        shards[storage] = time.time() - t0
    bf16 = {i: read_layer(wd / "model_dtype" / layer_file(i), dtype=torch.float32) for i in ids}
    fp8 = {i: read_layer(wd / "fp8_e4m3" / layer_file(i), dtype=torch.float32) for i in ids}
    ref_model = Reference(str(model))
    exact: dict[int, list[torch.Tensor]] = {i: [] for i in ids}
    for line in tokens.read_text().splitlines():  # the shard's rows in index order
        ref = ref_model.hidden_states(json.loads(line)["input_ids"], ids)
        for i in ids:
            exact[i].append(ref[i])
    exact_cat = {i: torch.cat(v) for i, v in exact.items()}
    stack_bf16 = torch.stack([bf16[i] for i in ids], dim=1)  # [T, L, H]
    stack_fp8 = torch.stack([fp8[i] for i in ids], dim=1)
    joint_bf16, export = joint(stack_bf16), joint(stack_fp8)
    grow = torch.tensor(GROWTH[: len(ids)], dtype=torch.float32)[None, :, None]
    grown = stack_bf16 * grow
    grown_joint = joint(grown)
    layers = {}
    for j, i in enumerate(ids):
        per_layer_grown = speculators_dequant(*quantize_fp8(grown[:, j]))
        layers[str(i)] = {
            "mean_token_norm": float(bf16[i].norm(dim=-1).mean()),
            "bf16_vs_fp32": stats(bf16[i], exact_cat[i]),
            "store_bf16": stats(exact_cat[i].to(torch.bfloat16), exact_cat[i]),
            "store_fp8": stats(roundtrip_fp8(exact_cat[i]), exact_cat[i]),
            "fp8_vs_bf16": stats(fp8[i], bf16[i]),
            "fp8_vs_fp32": stats(fp8[i], exact_cat[i]),
            "joint_vs_bf16": stats(joint_bf16[:, j], bf16[i]),
            "export_vs_bf16": stats(export[:, j], bf16[i]),
            "grown_per_layer_vs_bf16": stats(per_layer_grown, grown[:, j]),
            "grown_joint_vs_bf16": stats(grown_joint[:, j], grown[:, j]),
        }
    return {
        "model": name,
        "num_hidden_layers": n,
        "hidden_size": hidden,
        "layer_ids": ids,
        "tokens": int(stack_bf16.shape[0]),
        "rows": rows,
        "bytes_per_token_per_layer": {
            "bf16": token_bytes("model_dtype", hidden, "bfloat16"),
            "fp8_e4m3": token_bytes("fp8_e4m3", hidden, "bfloat16"),
        },  # fmt: skip
        "layer_file_bytes": {
            s: sum((wd / s / layer_file(i)).stat().st_size for i in ids) for s in ("model_dtype", "fp8_e4m3")
        },
        "extract_s": {k: round(v, 2) for k, v in shards.items()},
        "layers": layers,
    }


COLUMNS = ("bf16_vs_fp32", "store_bf16", "store_fp8", "fp8_vs_bf16", "fp8_vs_fp32", "joint_vs_bf16", "export_vs_bf16")


def table(results: list[dict]) -> str:
    lines = ["# per-token relative error: mean / p99 / max (min cosine of fp8 vs bf16)", ""]
    head = "| model (H) | id | |x| | " + " | ".join(COLUMNS) + " | fp8 min cos |"
    lines += [head, "|" + "---|" * (len(COLUMNS) + 4)]
    for r in results:
        for lid, layer in r["layers"].items():
            cells = [f"{layer[c]['mean']:.4f} / {layer[c]['p99']:.4f} / {layer[c]['max']:.4f}" for c in COLUMNS]
            lines.append(
                f"| {r['model']} ({r['hidden_size']}) | {lid} | {layer['mean_token_norm']:.3g} | "
                + " | ".join(cells)
                + f" | {layer['fp8_vs_bf16']['min_cos']:.5f} |"
            )
    lines += ["", f"# grown: layer slots scaled by {GROWTH} before quantizing (synthetic depth growth)", ""]
    lines += ["| model | id | x | per-layer scale (our shard) | joint scale (speculators) |", "|---|---|---|---|---|"]
    for r in results:
        for j, (lid, layer) in enumerate(r["layers"].items()):
            a, b = layer["grown_per_layer_vs_bf16"], layer["grown_joint_vs_bf16"]
            lines.append(
                f"| {r['model']} | {lid} | {GROWTH[j]:g} | {a['mean']:.4f} / {a['p99']:.4f} / {a['max']:.4f} | "
                f"{b['mean']:.4f} / {b['p99']:.4f} / {b['max']:.4f} |"
            )
    lines += ["", "# bytes per token and layer (values + scale) and the layer files of each capture", ""]
    for r in results:
        b, f = r["bytes_per_token_per_layer"], r["layer_file_bytes"]
        lines.append(
            f"{r['model']}: H {r['hidden_size']}: bf16 {b['bf16']} B, fp8 {b['fp8_e4m3']} B "
            f"({b['fp8_e4m3'] / b['bf16']:.3f}); {r['tokens']} tokens x {len(r['layer_ids'])} layers: "
            f"{f['model_dtype']:,} B bf16, {f['fp8_e4m3']:,} B fp8 ({f['fp8_e4m3'] / f['model_dtype']:.3f})"
        )
    for h in (4096, 5120, 7168, 8192):
        bf, f8 = token_bytes("model_dtype", h, "bfloat16"), token_bytes("fp8_e4m3", h, "bfloat16")
        lines.append(f"H {h}: bf16 {bf} B, fp8 {f8} B per token and layer ({f8 / bf:.4f})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--models", nargs="+", default=["demo", "llama", "qwen3_moe", "deepseek_v3"])
    ap.add_argument("--rows", type=int, default=8)
    args = ap.parse_args()
    unknown = [m for m in args.models if m != "demo" and m not in FAMILIES]
    if unknown:
        ap.error(f"unknown models {unknown}; demo or one of {FAMILIES}")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    header = (
        f"# {time.strftime('%Y-%m-%d')} {platform.machine()} cpu, torch {torch.__version__}, python "
        f"{platform.python_version()}; hf backend, bf16 capture, {args.rows} synthetic rows per model"
    )
    results = [run_model(m, args.out, args.rows) for m in args.models]
    (args.out / "fp8_error.json").write_text(json.dumps(results, indent=1))
    print(header + "\n\n" + table(results))


if __name__ == "__main__":
    sys.exit(main())
