"""Tests of eagle3prep.demo: the offline demo target is deterministic and shaped as the workflow expects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3prep.demo import build_demo_model
from eagle3prep.infra.atomic import sha256_file

DEMO_CORPUS = Path(__file__).resolve().parents[1] / "resources" / "demo" / "tokenizer_corpus.txt"


@pytest.fixture(scope="module")
def second_build(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo_again") / "model", DEMO_CORPUS)


def test_two_builds_are_byte_identical(demo_model_dir, second_build):
    first = {p.name: sha256_file(p) for p in sorted(demo_model_dir.iterdir())}
    second = {p.name: sha256_file(p) for p in sorted(second_build.iterdir())}
    assert first == second
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(first)


def test_config_shape(demo_model_dir):
    from transformers import AutoTokenizer

    config = json.loads((demo_model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 8
    assert config["head_dim"] == 32  # vLLM's CPU attention backend needs 32, 64, ...
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]
    assert config["vocab_size"] == len(tokenizer) == 512
    assert config["tie_word_embeddings"] is False
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|pad|>"


def test_chat_template_has_generation_markers(demo_model_dir):
    from transformers import AutoTokenizer

    template = (demo_model_dir / "chat_template.jinja").read_text()
    assert "{%- generation -%}" in template and "{%- endgeneration -%}" in template
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == text.removesuffix("<|im_start|>assistant\n")


def test_every_layer_moves_the_residual_stream(demo_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir).eval()
    n = model.config.num_hidden_layers
    ids = tokenizer("The telescope shows a bright comet in the small orbit.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    assert len(hidden) == n + 1
    # hidden[k] is the input of layer k for k < N; a layer that barely changes it would let an off-by-one hide.
    for k in range(n - 1):
        rel = ((hidden[k + 1] - hidden[k]).norm() / hidden[k].norm()).item()
        assert rel > 0.1, f"layer {k} changes the residual stream by only {rel:.3f}"
    assert not torch.allclose(model.model.norm.weight, torch.ones_like(model.model.norm.weight))


def test_failed_build_leaves_no_folder(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="tokenizer corpus is empty"):
        build_demo_model(tmp_path / "model", empty)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]
