"""bench_extract's model shapes (Llama-3.1-8B, a tiny one for the CPU smoke) and token workloads: random
ids in uniform and mixed-length rows, a config-only model folder, and the FLOPs a token costs."""

from __future__ import annotations

import json
import random
from pathlib import Path

PEAK_TFLOPS = 790.0
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


def make_model_dir(out: Path, shape: dict, max_len: int) -> Path:
    """OUT/model as a config alone: vLLM loads it with load_format="dummy", transformers with from_config."""
    import transformers

    d = out / "model"
    cfg = transformers.LlamaConfig(
        **shape,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        max_position_embeddings=max(max_len + 16, 4096),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    cfg.save_pretrained(d)  # config only: vLLM loads with load_format="dummy", transformers from_config
    return d


def workloads(args) -> dict[str, list[list[int]]]:
    """Random token ids (seed 0): `rows` rows of `seq` tokens, their first half, and mixed-length rows
    (--min-len to --max-len) of about as many tokens."""
    rnd = random.Random(0)
    vocab = (TINY if args.tiny else LLAMA_8B)["vocab_size"]
    uniform = [[rnd.randrange(5, vocab) for _ in range(args.seq)] for _ in range(args.rows)]
    mixed, total = [], 0
    while total < args.rows * args.seq:
        n = rnd.randint(args.min_len, args.max_len)
        mixed.append([rnd.randrange(5, vocab) for _ in range(n)])
        total += n
    return {"uniform_half": uniform[: args.rows // 2], "uniform": uniform, "mixed": mixed}


def write_tokenized(path: Path, rows: list[list[int]]) -> Path:
    """The rows as the tokenize stage's JSONL (every token in the loss mask), for extract_shard."""
    with open(path, "w") as f:
        for i, ids in enumerate(rows):
            f.write(
                json.dumps(
                    {"row": i, "id": str(i), "input_ids": ids, "loss_mask": [1] * len(ids), "seq_len": len(ids)}
                )
                + "\n"
            )
    return path


def flops_per_token(shape: dict, seq: float) -> float:
    """Dense prefill FLOPs per token: 2 x non-embedding weights + causal attention (2 L seq d)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i  # q, o, k, v, gate/up/down
    return 2 * n * per_layer + 2 * n * seq * h


def layer_ids(shape: dict) -> list[int]:
    """The layers eagle3prep captures for this shape (default_layer_ids)."""
    from eagle3prep.layers import default_layer_ids

    return default_layer_ids(shape["num_hidden_layers"])
