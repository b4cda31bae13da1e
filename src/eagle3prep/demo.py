"""The tiny offline demo target: a ByteLevel BPE tokenizer with a ChatML template and a random Llama.

Built from text shipped in the repo, with no download, byte-identical on every run (same sha256 for
every file). With the shipped corpus: vocabulary 512, 8 layers, hidden 128, 1.31M parameters, a
5.3 MB float32 `model.safetensors`; the build takes about 5 s on a 2-core CPU.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from eagle3prep.infra.atomic import fsync_dir

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512
NUM_HIDDEN_LAYERS = 8  # the demo model's depth, known before the model.build_demo rule builds it
MAX_POSITIONS = 1024

# ChatML. The assistant content and its <|im_end|> sit inside {% generation %} so that
# apply_chat_template(return_assistant_tokens_mask=True) marks exactly them; the "\n" after
# <|im_end|> is template glue and stays outside. transformers renders with trim_blocks/lstrip_blocks.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_tokenizer(corpus_path: str | os.PathLike, vocab_size: int = VOCAB_SIZE):
    """Train a ByteLevel BPE tokenizer on `corpus_path` (one sentence a line) and wrap it for transformers.

    The demo model uses VOCAB_SIZE; bench/bench_cpu_stages.py also trains a larger one, whose longer
    tokens compress text like a real chat model's tokenizer does.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = Path(corpus_path).read_text(encoding="utf-8").splitlines()
    if not lines:
        raise ValueError(f"{corpus_path}: the tokenizer corpus is empty; run resources/demo/make_demo_data.py")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0..4, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no <unk>
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|im_end|>",  # end of an assistant turn, as in Qwen's ChatML tokenizers
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
    )


def build_model(tokenizer, seed: int = 1234):
    """A random 8-layer Llama whose every layer visibly moves the residual stream."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention takes head_dim in {32, 64, 80, 96, ...}
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        initializer_range=0.1,  # larger than the 0.02 default so layers are far from identity
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    # Norm weights of 1 + 0.2*N(0,1) instead of all ones: with unit norms every layer looks alike and
    # a capture that is one layer off could still pass a loose check.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
    return model


def check_model(model, tokenizer) -> None:
    """One forward: N+1 hidden states of width H, finite logits over the whole vocabulary."""
    import torch

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "How do I fix a bike chain?"}, {"role": "assistant", "content": "Slowly."}],
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    n, h = model.config.num_hidden_layers, model.config.hidden_size
    shapes = [tuple(s.shape) for s in out.hidden_states]
    assert shapes == [(1, len(ids), h)] * (n + 1), (
        f"expected {n + 1} hidden states of (1, {len(ids)}, {h}), got {shapes}"
    )
    assert torch.isfinite(out.logits).all(), "demo model produced non-finite logits"


def build_demo_model(out_dir: str | os.PathLike, corpus_path: str | os.PathLike, seed: int = 1234) -> Path:
    """Build tokenizer + tiny Llama into `out_dir` (safetensors, configs, tokenizer, chat template)."""

    def write(tmp: Path) -> None:
        tokenizer = build_tokenizer(corpus_path)
        model = build_model(tokenizer, seed)
        check_model(model, tokenizer)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_model_folder(out_dir, write)


def write_model_folder(out_dir: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp)` on a temp sibling folder of `out_dir`, then rename it onto `out_dir`.

    A killed build never leaves a half-written model folder under its final name.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{out_dir.name}.", dir=out_dir.parent))
    try:
        write(tmp)
        for path in tmp.iterdir():
            path.chmod(0o644)  # safetensors' writer leaves 0600
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
