"""A target with structure for the quality bench (bench/quality/): a Llama trained on the Python standard library.

    PYTHONPATH=tests python -m testkit.stdlib_target OUT [--size h200|toy] [--device cuda|cpu]

Writes OUT/model (config, bf16 safetensors, tokenizer with the demo's ChatML template), OUT/conversations
(train.jsonl from the training modules, heldout.jsonl from the held-out ones) and OUT/target.json (sizes,
steps, held-out loss and top-1 accuracy, sha256 of the corpus, tokenizer and weights, wall time).

Deterministic by construction (fixed seeds, fixed step count, deterministic kernels), so a second build
on the same machine image gives the same sha256: that is how two device sessions share one target (the
weights are too big to commit). `--size toy` builds a CPU-sized one in seconds for CI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from testkit.stdlib_corpus import Module, conversations, corpus_sha256, stdlib_modules, write_jsonl

# Deterministic cuBLAS; must be set before CUDA initialises (torch.use_deterministic_algorithms asks for it).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@dataclass(frozen=True)
class Size:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    batch: int
    steps: int
    lr: float
    max_modules: int | None  # None: the whole stdlib
    tokenizer_lines: int  # corpus lines the BPE is trained on (the first ones, in module order)


SIZES = {
    # ~36M parameters; about 20M training tokens (a few epochs of the stdlib's code and conversations).
    "h200": Size(8192, 512, 8, 8, 4, 1536, 1024, 32, 600, 1.5e-3, None, 400_000),
    # CI: seconds on two cores; the same code path, a vocabulary still above the byte alphabet.
    # head_dim 32: vLLM's CPU attention takes head_dim in {32, 64, 80, ...}.
    "toy": Size(1024, 64, 2, 2, 1, 128, 128, 4, 20, 3e-3, 40, 20_000),
}
SEED = 0


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_tokenizer(modules: list[Module], size: Size):
    """The demo's recipe (byte-level BPE, ChatML with {% generation %}) trained on the training code."""
    from eagle3prep.demo import build_tokenizer as demo_tokenizer

    lines = [ln for m in modules if not m.held_out for ln in m.text.splitlines() if ln.strip()]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as f:
        f.write("\n".join(lines[: size.tokenizer_lines]))
    try:
        tok = demo_tokenizer(f.name, vocab_size=size.vocab)
    finally:
        os.unlink(f.name)
    tok.model_max_length = 4096
    return tok


def documents(modules: list[Module], tok, held_out: bool) -> list[list[int]]:
    """Token ids of each module's raw text and of each of its conversations as the chat template renders
    them, so the target learns both the code and the conversation format it is prompted with."""
    docs = []
    for m in modules:
        if m.held_out != held_out:
            continue
        docs.append(tok(m.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        for conv in conversations(m):
            docs.append(tok.apply_chat_template(conv["messages"], tokenize=True, return_dict=True)["input_ids"])
    return docs


def packed(docs: list[list[int]], seq: int):
    """The documents concatenated and cut into rows of seq + 1 tokens (inputs and shifted labels)."""
    import torch

    flat = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    n = (len(flat) - 1) // seq
    return torch.stack([flat[i * seq : i * seq + seq + 1] for i in range(n)])


def make_model(tok, size: Size):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=size.hidden,
        intermediate_size=size.ffn,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.hidden // size.heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(SEED)
    return LlamaForCausalLM(cfg)


def lr_at(step: int, size: Size) -> float:
    warm = max(1, size.steps // 20)
    if step < warm:
        return size.lr * (step + 1) / warm
    return size.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, size.steps - warm))))


def train(model, rows, size: Size, device: str) -> list[float]:
    """AdamW, cosine schedule, bf16 autocast on the GPU; the row order from a seeded generator."""
    import torch

    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=size.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=False)
    gen = torch.Generator().manual_seed(SEED)
    epochs = math.ceil(size.steps * size.batch / len(rows))
    order, losses = torch.cat([torch.randperm(len(rows), generator=gen) for _ in range(epochs)]), []
    for step in range(size.steps):
        batch = rows[order[step * size.batch : (step + 1) * size.batch]].to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, size)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(round(loss.item(), 5))
    return losses


def evaluate(model, rows, device: str, max_rows: int = 64) -> dict:
    """Mean next-token loss and top-1 accuracy on held-out rows, in bf16 as vLLM serves the target."""
    import torch

    model.eval()
    total, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, min(len(rows), max_rows), 8):
            batch = rows[i : i + 8].to(device)
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
                logits = model(input_ids=batch[:, :-1]).logits.float()
            labels = batch[:, 1:]
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
            correct += (logits.argmax(-1) == labels).sum().item()
            n += labels.numel()
    return {"heldout_loss": round(total / max(n, 1), 4), "heldout_top1": round(correct / max(n, 1), 4), "tokens": n}


def build(out: Path, size_name: str, device: str) -> dict:
    import torch
    import transformers

    from eagle3prep.demo import write_model_folder

    size, t0 = SIZES[size_name], time.time()
    torch.use_deterministic_algorithms(True)
    modules = stdlib_modules(max_modules=SIZES[size_name].max_modules)
    tok = build_tokenizer(modules, size)
    train_rows = packed(documents(modules, tok, held_out=False), size.seq)
    eval_rows = packed(documents(modules, tok, held_out=True), size.seq)
    model = make_model(tok, size)
    losses = train(model, train_rows, size, device)
    metrics = evaluate(model, eval_rows, device)

    def write(tmp: Path) -> None:
        model.to(torch.bfloat16).save_pretrained(tmp)
        tok.save_pretrained(tmp)

    folder = write_model_folder(out / "model", write)
    convs = {held: [c for m in modules if m.held_out == held for c in conversations(m)] for held in (False, True)}
    write_jsonl(out / "conversations/train.jsonl", convs[False])
    write_jsonl(out / "conversations/heldout.jsonl", convs[True])
    summary = {
        "size": size_name,
        **asdict(size),
        "parameters": sum(p.numel() for p in model.parameters()),
        "modules": {"train": sum(not m.held_out for m in modules), "heldout": sum(m.held_out for m in modules)},
        "conversations": {"train": len(convs[False]), "heldout": len(convs[True])},
        "train_tokens_per_epoch": int(train_rows.numel()),
        "tokens_seen": size.steps * size.batch * size.seq,
        "loss_first_last": [losses[0], losses[-1]],
        "losses_every_50": losses[::50],
        **metrics,
        "sha256": {
            "corpus": corpus_sha256(modules),
            "tokenizer": sha256_file(folder / "tokenizer.json"),
            "weights": sha256_file(folder / "model.safetensors"),
        },
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        },
        "wall_s": round(time.time() - t0, 1),
    }
    (out / "target.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="h200")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--expect-weights", help="sha256 the weights must have (a rebuild of a recorded target)")
    opts = ap.parse_args(argv)
    summary = build(opts.out, opts.size, opts.device)
    print(json.dumps({k: v for k, v in summary.items() if k != "losses_every_50"}, indent=1))
    if opts.expect_weights and summary["sha256"]["weights"] != opts.expect_weights:
        print(f"error: weights {summary['sha256']['weights']} != expected {opts.expect_weights}: not the same target")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
