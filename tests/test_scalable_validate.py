"""validate.reference: scalable through validate_shard, with the full reference off: the window check and
the logits check (on the prompt logprobs the extract job stored) pass a right capture and fail every
planted mistake of the validation matrix, on a dense and on a DeepSeek-V3 (MLA + MoE) target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3prep.extract import extract_shard
from eagle3prep.layers import default_layer_ids
from eagle3prep.settings import ExtractSettings
from eagle3prep.validate import ValidationError, validate_shard

from testkit.matrix import write_rows
from testkit.planted import MISTAKES, plant
from testkit.shards import capture_spec, with_settings
from testkit.tiny_models import NUM_LAYERS, build_family

ROWS = 6  # rows 1 and 3 share a length (rows_swapped); logprob rows 0, 1, 3, 4 include both


def verdict(shard: Path, tokens: Path, model: Path, out: Path, window: list[int]) -> tuple[bool, list[str], str]:
    try:
        report = validate_shard(
            str(shard),
            str(tokens),
            str(out),
            str(model),
            reference="scalable",
            windows=[window],
            sample_rows="auto",
            seed=0,
            device="cpu",
            trust_remote_code=False,
        )
    except ValidationError as e:
        return False, e.failed, str(e)
    assert report["reference_mode"] == "scalable" and "reference" not in report  # no full forward ran
    return True, [], ""


@pytest.mark.parametrize(
    ("family", "storage"), [("llama", "model_dtype"), ("deepseek_v3", "model_dtype"), ("llama", "fp8_e4m3")]
)
def test_scalable_checks_pass_right_data_and_catch_every_planted_mistake(tmp_path, family, storage):
    import transformers

    model = build_family(family, tmp_path / family)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ids = default_layer_ids(NUM_LAYERS)  # what the planted shards claim to hold; the window is their last two
    every = list(range(1, NUM_LAYERS + 1))  # captured: the neighbours the layer-off-by-one mistakes take
    spec = capture_spec(
        backend="hf",
        model_path=str(model),
        layer_ids=every,
        dtype="bfloat16",
        max_seq_len=256,
        device="cpu",
        tp_size=1,
    )
    shards, tokens = [], []
    for k in range(2):
        tokens.append(write_rows(tmp_path / f"tokens_{k}.jsonl", ROWS, vocab, k, k * ROWS))
        shards.append(tmp_path / f"shard_{k}")
        settings = ExtractSettings.defaults(logprob_rows=4, storage=storage, batch_tokens=512)
        extract_shard(str(tokens[k]), str(shards[k]), with_settings(spec, settings), shard=k)
    assert (shards[0] / "logprobs.safetensors").is_file()

    window = ids[-2:]
    ok, failed, message = verdict(shards[0], tokens[0], model, tmp_path / "v.json", window)
    assert ok, message
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def final_norm(x):
        with torch.no_grad():
            return hf.model.norm(x)

    scale = float(getattr(hf.config, "routed_scaling_factor", 2.5) or 2.5)
    caught = {}
    for mistake in MISTAKES:
        bad = plant(mistake, shards[0], tmp_path / mistake, ids, final_norm, scale, other=shards[1])
        ok, failed, message = verdict(bad, tokens[0], model, tmp_path / f"v_{mistake}.json", window)
        assert not ok, f"{mistake} passed the scalable checks"
        assert set(failed) <= {"logits", f"window:{window[0]}-{window[1]}"}, (mistake, failed)
        caught[mistake] = failed
    print(family, caught)
