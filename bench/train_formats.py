"""The trainer's pace on each storage format: speculators' trainer (eagle3prep-train, the direct backend) on the
same rows captured as bf16 and MXFP4 (and FP8, when asked) shards, on one GPU; the step time of each and its ratio to bf16's.

    python bench/train_formats.py OUT [--hidden 4096] [--rows 40] [--seq 4096] [--steps 30] [--workers 8]
                                      [--formats model_dtype mxfp4 [fp8_e4m3]]

Everything is made here, offline: a random Llama of the given width (4 layers, a 32,000-id vocabulary, the demo
tokenizer for its files), random rows of `--seq` tokens, each format's shard captured from that target by the
package's own capture (extract_shard, the hf backend on the GPU), validated (no reference forward) and exported
direct. The trainer then runs `--steps` steps from each export in its own process, a 1-layer eagle3 draft over
8,192 draft ids, `--workers` loader workers; speculators times every step (its profile: step_ms from the end of
the last step to the end of this one's optimizer, fetch_ms the wait for the batch and its copy to the GPU). The
first 5 steps are left out (workers starting). The loader decodes a scaled shard to bfloat16 in its workers, so
the ratio says whether the workers keep up with the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test kit (testkit.calls)
LAYER_IDS = [1, 2, 3, 4]  # three auxiliary layers and N (4 layers)
VOCAB, DRAFT_VOCAB, WARMUP = 32000, 8192, 5


def make_target(out: Path, hidden: int, device: str) -> Path:
    """A random bf16 Llama of width `hidden` (8B's shape per layer at 4096), 4 layers, with the demo tokenizer."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3prep.demo import build_tokenizer

    tokenizer = build_tokenizer(REPO / "resources/demo/tokenizer_corpus.txt")
    heads = max(1, hidden // 128)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 7 // 2, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 4), num_hidden_layers=len(LAYER_IDS), vocab_size=VOCAB,
                      max_position_embeddings=32768, tie_word_embeddings=False,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):  # ~1.1 G parameters at 4096: drawn on the GPU, in seconds
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_rows(wd: Path, rows: int, seq: int) -> tuple[Path, Path]:
    """`rows` rows of `seq` random ids, the second half loss-masked in, as tokenize writes them."""
    import random

    from eagle3prep.overfit_gate.rows import write_rows

    rng = random.Random(0)
    made = []
    for i in range(rows):
        ids = [rng.randrange(3, VOCAB) for _ in range(seq)]
        made.append({"row": i, "id": f"r{i}", "input_ids": ids, "loss_mask": [0] * (seq // 2) + [1] * (seq - seq // 2),
                     "seq_len": seq})  # fmt: skip
    tok, freq = wd / "tokenized/shard_0.jsonl", wd / "tokenized/token_freq.json"
    write_rows(made, tok, freq)
    return tok, freq


def capture(wd: Path, model: Path, tok: Path, freq: Path, storage: str, seq: int, device: str) -> tuple[Path, int]:
    """The rows captured in `storage` (the package's capture, hf backend on the GPU), validated, exported
    direct: (the export, the shard's bytes)."""
    from eagle3prep.backends.base import CaptureSpec
    from eagle3prep.export import export_speculators
    from eagle3prep.extract import extract_shard
    from eagle3prep.settings import ExtractSettings

    from testkit import calls

    shard, val, export = wd / storage / "shard_0", wd / storage / "validation.json", wd / storage / "export"
    settings = ExtractSettings.defaults(
        storage=storage, batch_tokens=seq, backend="hf", dtype="bfloat16", device=device
    )
    extract_shard(str(tok), str(shard), CaptureSpec(settings, str(model), LAYER_IDS, seq), shard=0)
    report = calls.validate(shard, tok, val, model, reference=False, device=device)
    if not report["ok"]:
        sys.exit(f"{storage}: validation did not pass: {val}")
    export_speculators([str(shard)], [str(val)], [str(tok)], str(freq), str(export), hidden_states="direct")
    return export, sum(f.stat().st_size for f in shard.glob("layer_*.safetensors"))


def train(export: Path, model: Path, out: Path, steps: int, seq: int, workers: int, device: str) -> list[dict]:
    """speculators' trainer from `export` in a child process; each step's profile (speculators' own timer)."""
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    manifest = json.loads((export / "manifest.json").read_text())
    args = [  # tests/testkit/train_both.py's recipe (a 1-layer eagle3 draft, eager loss, sdpa), one epoch
        *("--verifier-name-or-path", str(model), "--data-path", str(export), "--speculator-type", "eagle3"),
        *("--target-layer-ids", *map(str, manifest["target_layer_ids"])),
        *("--hidden-states-backend", manifest["hidden_states_backend"], "--on-missing", "raise"),
        *("--draft-vocab-size", str(DRAFT_VOCAB), "--total-seq-len", str(seq), "--train-data-ratio", "0.95"),
        *("--epochs", "1", "--max-steps", str(steps), "--seed", "0", "--num-workers", str(workers)),
        *("--loss-implementation", "eager", "--draft-attn-impl", "sdpa"),
        *("--save-path", str(out / "checkpoints"), "--log-dir", str(out / "logs"), "--checkpoint-freq", "1"),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    cpu = ["--cpu"] if device == "cpu" else []  # a smoke run on a host without a GPU
    cmd = [sys.executable, "-m", "eagle3prep.train", *cpu, "--metrics-jsonl", str(metrics), "--", *args]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["profile"] for r in records if "train" in r and r.get("profile")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=40, help="(95 %% train: more than --steps)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens a row, and the trainer's --total-seq-len")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workers", type=int, default=8, help="the trainer's --num-workers")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the bench itself (no timing meant)")
    ap.add_argument("--formats", nargs="+", default=["model_dtype", "mxfp4"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = make_target(args.out / "target", args.hidden, args.device)
    tok, freq = make_rows(args.out / "wd", args.rows, args.seq)
    print(f"# the trainer on each storage format: hidden {args.hidden}, {args.rows} rows of {args.seq} tokens, "
          f"layers {LAYER_IDS}, {args.steps} steps (first {WARMUP} left out), {args.workers} loader workers")  # fmt: skip
    results = {}
    for storage in args.formats:
        export, nbytes = capture(args.out / "wd", model, tok, freq, storage, args.seq, args.device)
        out = args.out / f"train_{storage}"
        prof = train(export, model, out, args.steps, args.seq, args.workers, args.device)[WARMUP:]
        if not prof:
            sys.exit(f"{storage}: no profiled step after the first {WARMUP}: raise --steps")
        results[storage] = {
            "shard_bytes": nbytes,
            "steps": len(prof),
            **{k: statistics.median(p[k] for p in prof) for k in ("step_ms", "fetch_ms", "fwd_ms", "bwd_ms")},
            "tokens_per_s": statistics.median(p["tokens_per_s"] for p in prof),
        }
    base = results.get("model_dtype")
    print("\n| storage | layer files | median step ms | fetch ms | fwd ms | bwd ms | tokens/s | step / bf16's |")
    print("|---|---|---|---|---|---|---|---|")
    for storage, r in results.items():
        ratio = f"{r['step_ms'] / base['step_ms']:.3f}" if base else ""
        print(f"| {storage} | {r['shard_bytes'] / 2**20:,.1f} MiB | {r['step_ms']:.1f} | {r['fetch_ms']:.1f} | "
              f"{r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} | {r['tokens_per_s']:,.0f} | {ratio} |")  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    print(f"\n{time.perf_counter() - t0:.0f} s in all; {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
