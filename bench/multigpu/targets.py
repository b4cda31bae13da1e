"""The targets and data of bench/multi_gpu.py: the model folders (built in a child process, so the bench
itself never touches a GPU), DeepSeek-V3's shapes, and bench_cpu_stages' synthetic conversations."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from multigpu import REPO, SCRIPT

CORPUS = REPO / "resources/demo/tokenizer_corpus.txt"
DEMO_SOURCES = ["resources/demo/sharegpt.jsonl", "resources/demo/openai.jsonl"]
TOKENS_PER_CONVERSATION = 549  # bench_cpu_stages' synthetic conversations, demo tokenizer (docs/runs/cpu_bench.txt)

# DeepSeek-V3's config.json shapes (MLA, 256 routed experts of 2048, top 8 in 4 of 8 groups, one shared
# expert), with fewer layers: layer 0 dense (V3 has 3), the rest MoE, so most of the model is experts.
# topk_method, scoring_func and moe_layer_freq are read by vLLM, not by transformers' config class.
DEEPSEEK_V3 = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    rope_interleave=True,
    n_shared_experts=1,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    moe_layer_freq=1,
    first_k_dense_replace=1,
    num_mtp_layers=0,
)
TINY_DEEPSEEK = dict(  # the CPU smoke's stand-in: tiny_models' DeepSeek-V3 dims
    DEEPSEEK_V3,
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=256,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
)


def build_model(target: str, folder: Path, layers: int, device: str) -> Path:
    """The target's folder, built once in a child process: the bench process itself never touches a
    GPU, so nvidia-smi's compute apps are the jobs' alone and no CUDA context of ours takes memory."""
    if (folder / "config.json").exists():
        return folder
    cmd = [sys.executable, str(SCRIPT), "_build", str(folder), "--target", target, "--layers", str(layers)]
    subprocess.run([*cmd, "--device", device], check=True)
    return folder


def build_target_folder(folder: Path, target: str, layers: int, device: str) -> None:
    """Random weights saved with the demo tokenizer and chat template (the workflow needs both);
    validation recomputes from these same weights, so vLLM must not draw its own (load_format dummy)."""
    import torch
    import transformers

    from eagle3prep.demo import build_demo_model, build_tokenizer, write_model_folder

    if target == "demo":
        build_demo_model(folder, CORPUS)
        return
    from extractbench.workload import LLAMA_8B

    def write(tmp: Path) -> None:
        tok = build_tokenizer(CORPUS)
        special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        if target == "llama8b":
            shape = LLAMA_8B
            cfg = transformers.LlamaConfig(
                **shape,
                head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                max_position_embeddings=4096,
                tie_word_embeddings=False,
                **special,
            )
        else:
            cfg = deepseek_config(layers, tiny=device == "cpu", **special)
        torch.manual_seed(0)
        with torch.device("cuda" if device == "cuda" else "cpu"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(tmp, max_shard_size="5GB")
        tok.save_pretrained(tmp)

    write_model_folder(folder, write)


def deepseek_config(layers: int, tiny: bool = False, **extra: Any):
    """DeepSeek-V3's config at `layers` decoder layers (tiny: the CPU smoke's dims), with the keys only
    vLLM reads set on it after transformers' config class has taken the rest."""
    import transformers

    shape = dict(TINY_DEEPSEEK if tiny else DEEPSEEK_V3)
    vllm_only = {k: shape.pop(k) for k in ("topk_method", "scoring_func", "moe_layer_freq")}
    cfg = transformers.DeepseekV3Config(
        **shape, num_hidden_layers=layers, max_position_embeddings=8192, tie_word_embeddings=False, **extra
    )
    for k, v in vllm_only.items():
        setattr(cfg, k, v)
    return cfg


def save_moe_config(folder: Path, layers: int, device: str) -> None:
    """moe-prefill's target: the config alone, since vLLM draws random weights (load_format dummy)."""
    cfg = deepseek_config(layers, tiny=device == "cpu")
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.save_pretrained(folder)


def synthetic_data(out: Path, tokens: int) -> Path:
    """Enough of bench_cpu_stages' synthetic conversations for `tokens` tokens (demo tokenizer), once."""
    from bench_cpu_stages import synthetic_conversations

    n = math.ceil(tokens / TOKENS_PER_CONVERSATION)
    path = out / "data" / f"conversations_{n}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for conv in synthetic_conversations(n):
                f.write(json.dumps(conv) + "\n")
        tmp.rename(path)
    return path


def model_folder(args) -> Path:
    """OUT/model-<target>, with the layer count for deepseek-v3: one folder per built target."""
    return args.out / (f"model-{args.target}" + (f"-l{args.layers}" if args.target == "deepseek-v3" else ""))


def prepare_inputs(args) -> tuple[Path, list[str]]:
    """The target's folder (built when missing) and the data sources of the run's config."""
    model = build_model(args.target, model_folder(args), args.layers, args.device)
    if args.data == "demo":
        return model, DEMO_SOURCES
    return model, [str(synthetic_data(args.out, args.shards * args.tokens_per_shard))]
