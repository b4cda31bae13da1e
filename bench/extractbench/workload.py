"""bench_extract's model shapes (Llama-3.1-8B, a tiny one for the CPU smoke) and token workloads: random
ids in uniform and mixed-length rows, a config-only model folder, and the FLOPs a token costs. With
--images: a Qwen2.5-VL-7B-shaped folder (a tiny one with --tiny) and image-heavy rows made by the project's
prepare and tokenize."""

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

# Kimi-K2.5's vocabulary and hidden size on a Llama body of 8 layers (--shape kimi-vocab): the logits check's
# prompt logprobs scale with the vocabulary, the capture's bytes with the hidden size (long rows' memory)
KIMI_VOCAB = dict(
    hidden_size=7168,
    intermediate_size=18432,
    num_hidden_layers=8,
    num_attention_heads=56,
    num_key_value_heads=8,
    vocab_size=163840,
)

# Qwen2.5-VL-7B-Instruct's config.json: its language model (as LLAMA_8B's keys) and its vision tower
QWEN25_VL_7B = dict(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064,
)  # fmt: skip
QWEN25_VL_7B_VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
)  # fmt: skip


def shapes(args) -> tuple[dict, dict | None]:
    """(the language model's shape, the vision tower's or None) that --tiny and --images ask for."""
    if not args.images:
        name = getattr(args, "shape_name", "")
        if name == KIMI_INT4:
            return kimi_int4_shape(args.out / "model"), None
        return (TINY if args.tiny else KIMI_VOCAB if name == "kimi-vocab" else LLAMA_8B), None
    from testkit.tiny_vl import VISION

    return (TINY, VISION) if args.tiny else (QWEN25_VL_7B, QWEN25_VL_7B_VISION)


def make_vl_model_dir(out: Path, shape: dict, vision: dict, max_len: int) -> Path:
    """OUT/model as a Qwen2.5-VL config of `shape` and `vision` with the demo tokenizer (Qwen's vision tokens
    added) and Qwen2.5-VL's own image processor settings: vLLM loads it with load_format="dummy" and builds
    its multimodal processor from it; tokenize reads the tokenizer and the image processor."""
    from testkit.tiny_vl import (
        QWEN25_VL_SIZE,
        build_image_processor,
        build_vl_tokenizer,
        save_processor,
        vl_config,
    )

    d = out / "model"
    tokenizer = build_vl_tokenizer()
    half = shape["hidden_size"] // shape["num_attention_heads"] // 2  # rotary pairs: temporal, height, width
    text = {k: v for k, v in shape.items() if k != "vocab_size"}
    text.update(
        max_position_embeddings=max(max_len + 16, 4096), mrope_section=[half // 4, *[(half - half // 4) // 2] * 2]
    )
    cfg = vl_config(tokenizer, text, vision, vocab_size=max(shape["vocab_size"], len(tokenizer)))
    cfg.dtype = "bfloat16"
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]  # as the model's own save writes it
    cfg.save_pretrained(d)  # config only, as make_model_dir
    tokenizer.model_max_length = text["max_position_embeddings"]
    save_processor(d, tokenizer, build_image_processor(QWEN25_VL_SIZE))
    return d


# --shape kimi-int4: the tiny Kimi-K2.5-shaped INT4 target of testkit.tiny_kimi, with its real weights
# (the matrix's kimi_int4 cell): its capture beside its own plain prefill. Rows fit its tokenizer's context.
KIMI_INT4 = "kimi-int4"
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def make_kimi_int4_dir(out: Path) -> Path:
    """OUT/model as the tiny Kimi INT4 target (built once, seed 0)."""
    from testkit.tiny_kimi import build_tiny_kimi

    d = out / "model"
    return d if (d / "config.json").exists() else build_tiny_kimi(d, "int4")


def kimi_int4_shape(model: Path) -> dict:
    cfg = json.loads((model / "config.json").read_text())
    return {k: cfg[k] for k in (*_SHAPE_KEYS, "vocab_size")}


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


def workloads(args) -> dict[str, list[list[int]] | Path]:
    """Random token ids (seed 0): `rows` rows of `seq` tokens, their first half, and mixed-length rows
    (--min-len to --max-len) of about as many tokens. --images: the tokenized shards the parent wrote
    (write_image_workloads), by name."""
    if args.images:
        return {k: Path(v) for k, v in json.loads((args.out / "work.json").read_text()).items()}
    rnd = random.Random(0)
    vocab = args.shape["vocab_size"]
    uniform = [[rnd.randrange(5, vocab) for _ in range(args.seq)] for _ in range(args.rows)]
    mixed, total = [], 0
    while total < args.rows * args.seq:
        n = rnd.randint(args.min_len, args.max_len)
        mixed.append([rnd.randrange(5, vocab) for _ in range(n)])
        total += n
    return {"uniform_half": uniform[: args.rows // 2], "uniform": uniform, "mixed": mixed}


def write_image_workloads(args, model: Path) -> dict[str, Path]:
    """Image-heavy tokenized shards under OUT/work_{uniform,mixed}/ (prepare and tokenize with `model`), the
    images drawn there (seed 0, each image its own pixels: nothing for a cache to reuse):
    uniform: --rows rows, each --images images of --image-size pixels square and a question and answer of
    about --text-words words; uniform_half: its first half; mixed: --rows rows of 0 to 2 x --images images,
    each of 1, 3/4 or 1/2 of --image-size a side (rounded to 28 pixels), and 1/2 to 2 x --text-words words."""
    from testkit.image_rows import Words, chat, draw_image, tokenize_records

    words, rnd, size = Words(0), random.Random(0), args.image_size
    sides = sorted({max(28, round(size * f / 28) * 28) for f in (1, 0.75, 0.5)})
    out = {}
    for name in ("uniform", "mixed"):
        root = args.out / f"work_{name}"
        (root / "images").mkdir(parents=True, exist_ok=True)
        records = []
        for i in range(args.rows):
            n, w = (
                (args.images, args.text_words)
                if name == "uniform"
                else (rnd.randint(0, 2 * args.images), rnd.randint(args.text_words // 2, 2 * args.text_words))
            )
            names = []
            for j in range(n):
                side = size if name == "uniform" else rnd.choice(sides)
                names.append(f"r{i}i{j}.png")
                (root / "images" / names[-1]).write_bytes(
                    draw_image(side, side, seed=(i * 64 + j) * 2 + (name == "mixed"))
                )
            records.append(chat(names, words(w // 3), words(w - w // 3)))
        (out[name],) = tokenize_records(records, model, root, args.max_len)
    lines = out["uniform"].read_text(encoding="utf-8").splitlines(keepends=True)
    out["uniform_half"] = out["uniform"].with_name("half.jsonl")
    out["uniform_half"].write_text("".join(lines[: len(lines) // 2]), encoding="utf-8")
    (args.out / "work.json").write_text(json.dumps({k: str(v) for k, v in out.items()}))
    return out


def image_prompts(tokenized: Path, model: Path) -> list:
    """vLLM prompts of a tokenized shard's rows as the vllm backend makes them: token ids, each image's run of
    placeholders collapsed to one (vLLM's processor expands it again), and the row's images."""
    from vllm import TokensPrompt

    from eagle3prep.tokenize.row_inputs import RowImages
    from eagle3prep.tokenize.vision import collapse_runs

    images, prompts = RowImages(model, tokenized), []
    for line in tokenized.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if not row.get("images"):
            prompts.append(TokensPrompt(prompt_token_ids=row["input_ids"]))
            continue
        ids = collapse_runs(row["input_ids"], images.image_token_id)
        prompts.append(TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": images.images(row)}))
    return prompts


def tokens_of(tokenized: Path) -> int:
    """The tokens of a tokenized shard (image tokens expanded, as the model sees them)."""
    return sum(json.loads(line)["seq_len"] for line in tokenized.read_text(encoding="utf-8").splitlines())


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
