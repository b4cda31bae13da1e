"""Tests of testkit.tiny_models: deterministic tiny targets whose configs say what vLLM needs."""

from __future__ import annotations

import json

import pytest

from eagle3prep.infra.atomic import sha256_file

from testkit.tiny_models import FAMILIES, MIN_UPDATE, NUM_LAYERS, build_family, chat_ids, layer_updates

BUILT = ("qwen2_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return {name: build_family(name, out / name) for name in BUILT}


def test_two_builds_are_byte_identical(built, tmp_path):
    again = build_family("qwen2_moe", tmp_path / "qwen2_moe")
    first = {p.name: sha256_file(p) for p in sorted(built["qwen2_moe"].iterdir())}
    assert first == {p.name: sha256_file(p) for p in sorted(again.iterdir())}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(first)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".build-")]  # no temp folder left


def test_config_facts(built):
    qwen = json.loads((built["qwen2_moe"] / "config.json").read_text())
    assert qwen["architectures"] == ["Qwen2MoeForCausalLM"] and qwen["num_hidden_layers"] == NUM_LAYERS
    assert qwen["num_attention_heads"] % 2 == 0 and qwen["num_key_value_heads"] % 2 == 0  # TP 2
    assert qwen["hidden_size"] // qwen["num_attention_heads"] == 64
    ds = json.loads((built["deepseek_v3"] / "config.json").read_text())
    assert ds["architectures"] == ["DeepseekV3ForCausalLM"] and ds["num_hidden_layers"] == NUM_LAYERS
    # Keys transformers' DeepseekV3Config has no field for but vLLM reads (sigmoid, biased routing).
    assert (ds["topk_method"], ds["scoring_func"], ds["moe_layer_freq"]) == ("noaux_tc", "sigmoid", 1)
    assert (ds["kv_lora_rank"], ds["q_lora_rank"], ds["qk_rope_head_dim"], ds["qk_nope_head_dim"]) == (
        512,
        256,
        64,
        128,
    )
    assert ds["rope_interleave"] is True and ds["routed_scaling_factor"] == 2.827
    assert ds["first_k_dense_replace"] == 1 and ds["n_routed_experts"] % ds["n_group"] == 0


def test_unknown_family_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown family 'mamba'"):
        build_family("mamba", tmp_path / "m")
    assert len(FAMILIES) == 5


def test_forward_is_finite_and_every_layer_moves_the_stream(built):
    """On the saved folder as transformers loads it (build_family checks the model it built, too)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built["deepseek_v3"])
    model = AutoModelForCausalLM.from_pretrained(built["deepseek_v3"], dtype=torch.float32).eval()
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0  # loaded, not zeros
    updates = layer_updates(model, chat_ids(tokenizer))  # raises on non-finite logits
    assert len(updates) == NUM_LAYERS and min(updates) >= MIN_UPDATE, updates
