"""Reasoning-length rows through capture and validation on a GPU: no engine death, and the logits check on.

    python bench/long_rows.py OUT [--shape narrow|kimi-vocab] [--lengths 32768,65536] [--capture-path auto]
                                  [--layer-ids 1,2]

Builds a random Llama with real saved weights (validation recomputes from them): `narrow` is the 8B shape's
vocabulary (128,256) on a 4-layer body of hidden 1024; `kimi-vocab` is Kimi-K2.5's vocabulary (163,840) and
hidden size (7,168) on 2 layers. One shard of rows of --lengths tokens goes through extract_shard with the
default extract settings (4 logits-check rows a shard, 16,384-token steps, gpu_memory_utilization 0.85), then
validate_shard with `validate.reference: scalable` on the GPU: the window checks on every row and the logits
check on the rows whose prompt logprobs vLLM returned (a row over the logprob window on its first tokens). A
planted mistake (every row's states one token early) must fail. Prints one line per step, its command first.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test kit, tests/testkit

SHAPES = {
    "narrow": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                   num_key_value_heads=8, vocab_size=128256),
    "kimi-vocab": dict(hidden_size=7168, intermediate_size=18432, num_hidden_layers=2, num_attention_heads=56,
                       num_key_value_heads=8, vocab_size=163840),
}  # fmt: skip


def build_model(folder: Path, shape: dict, max_len: int) -> Path:
    """Random bf16 weights (seed 0), every norm weight moved off 1 so an off-by-one layer cannot hide."""
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        **shape,
        head_dim=128,
        max_position_embeddings=max_len + 16,
        tie_word_embeddings=False,
        initializer_range=0.02,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    del model  # the engine starts in this process next: its memory check wants the GPU free
    torch.cuda.empty_cache()
    return folder


def write_rows(path: Path, lengths: list[int], vocab: int) -> Path:
    rnd = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for i, n in enumerate(lengths):
            ids = [rnd.randrange(5, vocab) for _ in range(n)]
            row = {"row": i, "id": f"r{i}", "input_ids": ids, "loss_mask": [0] * 8 + [1] * (n - 8), "seq_len": n}
            f.write(json.dumps(row) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="narrow")
    ap.add_argument("--lengths", default="32768,65536,20000,4096", help="tokens of each row, comma-separated")
    ap.add_argument("--capture-path", default="auto", choices=["auto", "hooks", "builtin"])
    ap.add_argument("--layer-ids", type=lambda v: [int(x) for x in v.split(",")],
                    help="comma-separated (default: the shape's default ids); the built-in path, "
                    "the only one on vLLM 0.34, refuses id 0")  # fmt: skip
    args = ap.parse_args()
    print("command: python " + " ".join(sys.argv), flush=True)

    from eagle3prep.backends.base import CaptureSpec
    from eagle3prep.extract import extract_shard
    from eagle3prep.extract.backend import make_backend
    from eagle3prep.layers import default_layer_ids
    from eagle3prep.settings import ExtractSettings
    from eagle3prep.validate import ValidationError, validate_shard

    from testkit.planted import plant

    lengths = [int(x) for x in args.lengths.split(",")]
    shape = SHAPES[args.shape]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = build_model(args.out / f"model-{args.shape}", shape, max(lengths))
    print(f"model {args.shape}: {shape} built in {time.time() - t0:.0f} s", flush=True)
    tokens = write_rows(args.out / f"rows-{args.shape}.jsonl", lengths, shape["vocab_size"])
    ids = args.layer_ids or default_layer_ids(shape["num_hidden_layers"])
    settings = ExtractSettings.defaults(backend="vllm", dtype="bfloat16", device="cuda", tp_size=1,
                                        capture_path=args.capture_path, logprob_rows=len(lengths))  # fmt: skip
    spec = CaptureSpec(settings, model_path=str(model), layer_ids=ids, max_seq_len=max(lengths))
    shard = args.out / f"shard-{args.shape}-{args.capture_path}"
    t0 = time.time()
    backend = make_backend(spec)
    try:
        info = backend.probe()
        m = extract_shard(str(tokens), str(shard), spec, shard=0, engine=(backend, info))
    finally:
        backend.close()
    timings = json.loads((shard / "timings.json").read_text())
    print(
        f"extract: {m.tokens} tokens in rows of {lengths}, {info.capture_path} path, vLLM {info.engine_version}, "
        f"{timings['tokens_per_s']:.0f} tok/s, {time.time() - t0:.0f} s with the engine's start; "
        f"memory: {info.details.get('memory')}; notes: {(timings.get('writer') or {}).get('logprob_notes')}",
        flush=True,
    )

    def judge(where: Path, name: str) -> bool:
        t0 = time.time()
        try:
            report = validate_shard(str(where), str(tokens), str(args.out / f"v-{name}.json"), str(model),
                                    sample_rows=10**9, device="cuda", reference="scalable", seed=0, trust_remote_code=False, windows=None)  # fmt: skip
            logits = report["scalable"]["logits"]
            covered = [(v["covered_tokens"], v["row_tokens"], round(v["mean"], 4), v["ok"]) for v in logits]
            what = "logits check (covered, row tokens, mean |d| nats, ok)"
            print(f"validate {name}: PASS in {time.time() - t0:.0f} s; {what}: {covered}")
            return True
        except ValidationError as e:
            print(f"validate {name}: FAIL in {time.time() - t0:.0f} s {e.failed}: {str(e)[:400]}")
            return False

    right = judge(shard, "right")
    planted = shard.parent / f"{shard.name}-tokens_shifted"
    plant("tokens_shifted", shard, planted, ids)
    caught = not judge(planted, "tokens_shifted")
    print(
        f"verdict: right data {'passes' if right else 'FAILS'}; planted tokens_shifted {'caught' if caught else 'MISSED'}"
    )
    sys.exit(0 if right and caught else 1)


if __name__ == "__main__":
    main()
