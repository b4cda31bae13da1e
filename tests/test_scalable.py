"""The slice checks (eagle3prep.validate: window.py, logits.py, scalable.py) on tiny random models, with no full reference forward.

A bf16 shard captured by the hf backend passes the window check (ids 2->3->6) and the logits check
(stored logprobs faked by a full bf16 forward, what a right engine stores); each planted mistake fails
at least one. Which one: CAUGHT_BY below (RMSNorm hides a uniformly scaled id N from the logits check).
"""

from __future__ import annotations

import json
import random

import pytest

from eagle3prep.extract import extract_shard
from eagle3prep.layers import default_layer_ids
from eagle3prep.settings import ExtractSettings
from eagle3prep.shard import layer_file, read_index
from eagle3prep.validate.logits import check_logprobs
from eagle3prep.validate.scalable import check_memory
from eagle3prep.validate.slices import Checkpoint, raw_config
from eagle3prep.validate.window import check_window

from testkit.planted import MISTAKES, plant
from testkit.shards import capture_spec, with_settings
from testkit.tiny_models import NUM_LAYERS, build_family
from testkit.writers import reference_logprobs_hf

LENGTHS = [(24, 40, 31, 40), (33, 20, 27, 38)]  # per shard; rows 1 and 3 of shard 0 can be swapped
N = NUM_LAYERS
CLAIMED = default_layer_ids(N)  # [2, 3, 6]
WINDOWS = list(zip(CLAIMED[:-1], CLAIMED[1:], strict=False))

# Which check fails each planted mistake (on both families). rows_swapped keeps every row's ids
# consistent with each other, so only the tokens (the logits check) tell; a scaled id N normalises away.
CAUGHT_BY = {
    "layer_plus_one": {"window"},  # id N is unchanged, the window's input is not
    "layer_minus_one": {"window", "logits"},
    "post_norm_final": {"window", "logits"},
    "rows_swapped": {"logits"},
    "tokens_shifted": {"window", "logits"},
    "scaled": {"window"},
    "other_shard": {"window", "logits"},
}


def _tokens(path, lengths, seed, first_row):
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i, n in enumerate(lengths):
            ids = [rng.randrange(5, 500) for _ in range(n)]
            f.write(json.dumps({"row": first_row + i, "id": f"s{seed}r{i}", "input_ids": ids,
                                "loss_mask": [1] * n, "seq_len": n}) + "\n")  # fmt: skip
    return path


def _rows(shard, lid):
    import torch
    from safetensors import safe_open

    with safe_open(shard / layer_file(lid), framework="pt") as f:
        hs = f.get_tensor("hidden_states")
    return [hs[e.offset : e.offset + e.length].clone() for e in read_index(shard)] if hs.numel() else [torch.zeros(0)]


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def family(request, tmp_path_factory):
    """A tiny model, two bf16 shards captured by the hf backend, the planted copies of shard 0, stored logprobs."""
    import torch

    tmp = tmp_path_factory.mktemp(request.param)
    model = build_family(request.param, tmp / "model")
    spec = capture_spec(
        backend="hf",
        model_path=str(model),
        layer_ids=list(range(1, N + 1)),
        dtype="bfloat16",
        device="cpu",
        tp_size=1,
        max_seq_len=2048,
    )
    tokens, shards = [], []
    for k, lengths in enumerate(LENGTHS):
        tokens.append(_tokens(tmp / f"tokens_{k}.jsonl", lengths, k, k * 4))
        shards.append(tmp / f"shard_{k}")
        extract_shard(
            str(tokens[k]), str(shards[k]), with_settings(spec, ExtractSettings.defaults(batch_tokens=2048)), shard=k
        )
    ckpt = Checkpoint(model)
    norm = ckpt.head(torch.float32)[0]
    planted = {
        m: plant(m, shards[0], tmp / m, CLAIMED, lambda x: norm(x).detach(), 2.827, other=shards[1]) for m in MISTAKES
    }
    ids = [json.loads(line)["input_ids"] for line in tokens[0].read_text().splitlines()]
    stored = [reference_logprobs_hf(model, row) for row in ids]
    return {"ckpt": ckpt, "shard": shards[0], "planted": planted, "ids": ids, "stored": stored}


def run_checks(fam, shard) -> dict[str, list[dict]]:
    """{'window': verdicts of every window and row, 'logits': verdicts per row} of one shard."""
    out = {"window": [], "logits": []}
    for a, b in WINDOWS:
        out["window"] += check_window(fam["ckpt"], _rows(shard, a), _rows(shard, b), a, b, "bfloat16")
    out["logits"] = check_logprobs(fam["ckpt"], _rows(shard, N), fam["ids"], fam["stored"], "bfloat16")
    return out


def test_correct_capture_passes_both_checks(family):
    verdicts = run_checks(family, family["shard"])
    assert all(v["ok"] for v in verdicts["window"]), [v for v in verdicts["window"] if not v["ok"]]
    assert all(v["ok"] for v in verdicts["logits"]), [v for v in verdicts["logits"] if not v["ok"]]
    # Well inside the bounds, not just under them (the hf backend batches rows: close to, not equal to, the floor).
    assert max(v["rel"] / v["bound_rel"] for v in verdicts["window"]) < 0.5
    assert max(v["mean"] / v["bounds"]["mean"] for v in verdicts["logits"]) < 0.5


@pytest.mark.parametrize("mistake", MISTAKES)
def test_planted_mistake_is_caught(family, mistake):
    verdicts = run_checks(family, family["planted"][mistake])
    caught = {name for name, vs in verdicts.items() if not all(v["ok"] for v in vs)}
    assert caught == CAUGHT_BY[mistake], (mistake, caught)


def test_int4_experts_dequantize_with_compressed_tensors():
    """A pack-quantized tensor set (what Kimi-K2.5 stores per routed expert) becomes the weight it encodes."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    from eagle3prep.validate.slices import dequantize

    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 32}}}}  # fmt: skip
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    q = torch.randint(-8, 8, (64, 128)).float()
    scale = torch.rand(64, 4).to(torch.bfloat16) + 0.5
    weight = q * scale.float().repeat_interleave(32, dim=1)
    packed = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    loaders = {f"mlp.experts.0.up_proj.{k}": (lambda v=v: v) for k, v in packed.items()}
    out = dequantize(loaders, qc)
    assert list(out) == ["mlp.experts.0.up_proj.weight"]
    assert torch.equal(out["mlp.experts.0.up_proj.weight"]().float(), weight)


def test_memory_estimate_from_config_alone(tmp_path):
    """Kimi-K2.5's text config nested in its multimodal wrapper, no weights: the last window N-3 -> N."""
    text = dict(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], hidden_size=7168,
                num_hidden_layers=61, first_k_dense_replace=1, n_routed_experts=384, num_experts_per_tok=8,
                n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=18432, q_lora_rank=1536,
                kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                num_attention_heads=64, num_key_value_heads=64, vocab_size=163840, n_group=1, topk_group=1,
                tie_word_embeddings=False)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text}))
    assert raw_config(tmp_path)["hidden_size"] == 7168
    mem = check_memory(tmp_path, default_layer_ids(61), windows=None)  # windows 2->30, 30->58, 58->61
    assert mem["largest_window"] == [2, 30]
    routed = 384 * 3 * 7168 * 2048  # parameters of one layer's routed experts
    assert 3 * 2 * routed < mem["windows"]["58->61"] < 3 * 2 * routed * 1.02
    assert mem["layer_peak_bytes"] < mem["windows"]["58->61"] * 1.01  # one layer at bf16 + fp32
    assert mem["logits_bytes"] > 6 * 163840 * 7168
