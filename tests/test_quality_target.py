"""The quality bench's target (testkit.stdlib_target), its CPU-sized build.

The H200 build is the same code with SIZES["h200"]; its record is docs/runs/acceptance/target/target.json.
"""

from __future__ import annotations

import json

import pytest
import torch

from testkit import stdlib_corpus as corpus
from testkit import stdlib_target as target


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality_target")
    summary = target.build(out, "toy", "cpu")
    return out, summary


def test_the_split_holds_out_whole_modules_by_a_hash_of_their_path():
    modules = corpus.stdlib_modules()
    held = {m.rel for m in modules if m.held_out}
    assert 0.03 < len(held) / len(modules) < 0.2, "about a tenth of the modules are held out"
    # The split is a property of the path alone: the same module is held out whatever else is read.
    again = {m.rel for m in corpus.stdlib_modules(max_modules=50) if m.held_out}
    assert again <= held


def test_conversations_pair_a_docstring_with_its_body():
    m = corpus.Module(
        "pkg/mod.py",
        'import os\n\n\ndef f(a, b):\n    """Add two numbers, the long way round, for a test of the pairing rule."""\n'
        "    total = a + b  # the body the assistant writes\n    return total\n",
    )
    (conv,) = [c for c in corpus.conversations(m) if c["id"].endswith("#f0")]
    user, assistant = conv["messages"]
    assert user["role"] == "user" and "def f(a, b):" in user["content"] and "Add two numbers" in user["content"]
    assert assistant == {
        "role": "assistant",
        "content": "    total = a + b  # the body the assistant writes\n    return total\n",
    }


def test_the_toy_target_is_trained_records_its_held_out_loss_and_marks_replies(toy):
    out, summary = toy
    assert summary["loss_first_last"][1] < summary["loss_first_last"][0], "training lowered the loss"
    assert 0 < summary["heldout_loss"] < 10 and summary["tokens"] > 0
    assert (out / "target.json").exists() and json.loads((out / "target.json").read_text())["sha256"]["weights"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "model")
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert len(tok) == target.SIZES["toy"].vocab and model.dtype == torch.bfloat16
    conv = json.loads((out / "conversations/heldout.jsonl").read_text().splitlines()[0])
    enc = tok.apply_chat_template(conv["messages"], return_dict=True, return_assistant_tokens_mask=True)
    reply = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m]
    assert tok.decode(reply) == conv["messages"][1]["content"] + "<|im_end|>", "{% generation %} marks the reply"
    train_ids = {
        json.loads(x)["id"].split("#")[0] for x in (out / "conversations/train.jsonl").read_text().splitlines()
    }
    assert conv["id"].split("#")[0] not in train_ids, "held-out modules give no training conversation"
