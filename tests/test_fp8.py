"""FP8 storage (extract.storage: fp8_e4m3): speculators' quantization, the layer file layout and its
readers, the manifest, the plan's disk estimate and the pass rule's FP8 floor.

Capture, corruption, export, dataset and the planted mistakes on FP8 shards are tested next to their
model-dtype twins: test_sink, test_corruption, test_export, test_dataset, test_validation_matrix,
test_scalable_validate.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_export import LENGTHS, finished_results

from eagle3prep.extract import shard_bytes
from eagle3prep.plan.estimate import make_plan
from eagle3prep.shard.formats import FORMAT, FORMAT_FP8, storage_format
from eagle3prep.shard.fp8 import SCALES_KEY, dequantize_fp8, quantize_fp8, rounding_draw, roundtrip_fp8
from eagle3prep.shard.layout import MANIFEST, layer_file
from eagle3prep.shard.manifest import ShardManifest, read_manifest
from eagle3prep.shard.readers import LayerReader, read_layer
from eagle3prep.validate.passrule import STORAGE_FACTOR, judge_tokens, storage_floor, token_errors

from testkit.writers import write_layer


def states(tokens: int = 64, hidden: int = 96, seed: int = 0) -> torch.Tensor:
    """bf16 rows spanning 1e-3..1e3 in magnitude, with a zero row, a NaN and an Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g) * torch.logspace(-3, 3, tokens)[:, None]
    x[5] = 0.0
    x[9, 3] = float("nan")
    x[11, 7] = float("inf")
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(64, 96), (16, 4, 96)], ids=["layer-file", "export-stack"])
def test_quantization_is_speculators_own(shape):
    fp8_utils = pytest.importorskip("hs_connectors.fp8_utils", reason="speculators 0.9.0: make .venv/.installed")
    x = states(shape[0] * (shape[1] if len(shape) == 3 else 1)).reshape(shape)
    ours, theirs = quantize_fp8(x), fp8_utils.quantize_tensor_to_fp8(x)
    assert torch.equal(ours[0].view(torch.uint8), theirs[0].view(torch.uint8))  # NaN's bits included
    assert ours[1].shape == theirs[1].shape == (shape[0], *[1] * (len(shape) - 1))
    assert torch.equal(ours[1], theirs[1]) or torch.allclose(ours[1], theirs[1], equal_nan=True, rtol=0, atol=0)
    assert SCALES_KEY == fp8_utils.SCALES_KEY


def test_what_reads_back():
    x = states()
    q, s = quantize_fp8(x)
    back = dequantize_fp8(q, s)
    assert back.dtype == torch.float32 and dequantize_fp8(q, s, torch.bfloat16).dtype == torch.bfloat16
    assert bool((back[5] == 0).all()) and float(s[5]) == pytest.approx(1e-12)  # a zero token stays zero
    assert not bool(back[9].isfinite().any()) and not bool(back[11].isfinite().any())  # NaN, Inf: whole token
    ok = torch.ones(len(x), dtype=torch.bool)
    ok[[5, 9, 11]] = False
    err = token_errors(back[ok], x[ok])
    assert float(err.max()) < 0.04 and float(err.mean()) > 0.01  # e4m3: 3 mantissa bits, every magnitude
    assert bool((q.float().abs().amax(dim=1)[ok] == 448).all())  # each token's largest value sits at FP8's max
    assert torch.equal(roundtrip_fp8(back[ok]), back[ok])  # requantizing what an FP8 file holds changes nothing


def test_a_rounding_draw_stays_within_the_rounding_interval():
    x = states()[12:]  # finite rows
    q, s = quantize_fp8(x)
    stored = dequantize_fp8(q, s)
    draw = rounding_draw(stored, torch.Generator().manual_seed(1))
    again = (draw / s).to(torch.float8_e4m3fn)  # on the stored grid, it rounds back to the stored value
    assert float((again.float() == q.float()).float().mean()) > 0.999
    err = token_errors(draw, stored)
    assert 0.5 * float(token_errors(stored, x.float()).mean()) < float(err.mean()) < 0.04  # an FP8-sized error


def test_layer_reader_dequantizes_and_leaves_model_dtype_files_alone(tmp_path):
    x = states()[12:]
    write_layer(tmp_path / "bf16.safetensors", x)
    write_layer(tmp_path / "fp8.safetensors", x, "fp8_e4m3")
    plain, fp8 = LayerReader(tmp_path / "bf16.safetensors"), LayerReader(tmp_path / "fp8.safetensors")
    assert (plain.format.name, fp8.format.name) == ("model_dtype", "fp8_e4m3")
    assert plain.shape == fp8.shape == list(x.shape)
    assert torch.equal(plain.rows(3, 9), x[3:9])  # as stored
    assert fp8.rows(3, 9).dtype == torch.bfloat16  # what trainers read
    assert torch.equal(fp8.rows(3, 9, torch.float32), roundtrip_fp8(x)[3:9])
    assert torch.equal(read_layer(tmp_path / "fp8.safetensors", 3, 9, torch.float32), fp8.rows(3, 9, torch.float32))

    def data_bytes(path):  # the file less its header (whose metadata differs by format)
        raw = path.read_bytes()
        return len(raw) - 8 - int.from_bytes(raw[:8], "little")

    assert data_bytes(tmp_path / "fp8.safetensors") == data_bytes(tmp_path / "bf16.safetensors") * (96 + 4) / (2 * 96)


def test_fp8_shard_is_the_model_dtype_shard_quantized(tmp_path_factory, demo_model_dir):
    """The same rows captured twice (hf, CPU): every FP8 layer file is the bf16 one quantized, byte for
    byte; the manifest says how it is stored, and old readers are turned away by its format."""
    plain = finished_results(tmp_path_factory, demo_model_dir)
    fp8 = finished_results(tmp_path_factory, demo_model_dir, "fp8_e4m3")
    for k in range(len(LENGTHS)):
        a, b = plain / f"hidden_states/shard_{k}", fp8 / f"hidden_states/shard_{k}"
        ma, mb = read_manifest(a), read_manifest(b)
        assert (ma.format, ma.storage, mb.format, mb.storage_name) == (FORMAT, None, FORMAT_FP8, "fp8_e4m3")
        assert "storage" not in json.loads((a / MANIFEST).read_text())  # model-dtype manifests are as before
        assert mb.dtype == "bfloat16" and mb.storage["scales"] == {
            "key": SCALES_KEY,
            "dtype": "float32",
            "granularity": "per_token_per_layer",
            "math": "scale = max(amax / 448, 1e-12); value = fp8 x scale (speculators' fp8_utils)",
        }
        for lid in ma.layer_ids:
            ref = tmp_path_factory.mktemp("q") / "q.safetensors"
            write_layer(ref, read_layer(a / layer_file(lid)), "fp8_e4m3")
            assert (b / layer_file(lid)).read_bytes() == ref.read_bytes(), (k, lid)
            assert mb.files[layer_file(lid)]["dtype"] == "float8_e4m3fn"
        assert (a / "token_ids.safetensors").read_bytes() == (b / "token_ids.safetensors").read_bytes()


def test_manifest_format_and_storage_must_agree():
    m = read_manifest_fields()
    assert ShardManifest.from_json(m).storage_name == "model_dtype"  # an older /1 manifest: no storage key
    fp8 = {**m, "format": FORMAT_FP8, "storage": {"name": "fp8_e4m3"}}
    assert ShardManifest.from_json(fp8).storage_name == "fp8_e4m3"
    with pytest.raises(ValueError, match="with storage 'model_dtype'"):
        ShardManifest.from_json({**m, "format": FORMAT_FP8})
    with pytest.raises(ValueError, match="with storage 'fp8_e4m3'"):
        ShardManifest.from_json({**fp8, "format": FORMAT})


def read_manifest_fields() -> dict:
    from testkit.shards import manifest_fields

    return {
        **manifest_fields(),
        "files": {},
        "rows": 0,
        "tokens": 0,
        "layer_ids": [8],
        "format": FORMAT,
    }


def test_plan_and_the_disk_precheck_halve_with_fp8(tmp_path):
    shards = [{"shard": 0, "rows": 1000, "tokens": 1_000_000}]
    model, fp8_e4m3 = storage_format("model_dtype"), storage_format("fp8_e4m3")
    plain = make_plan(shards, 4, 4096, "bfloat16", tmp_path, tokens_per_s=None, engine_start_s=60, storage=model)
    fp8 = make_plan(shards, 4, 4096, "bfloat16", tmp_path, storage=fp8_e4m3, tokens_per_s=None, engine_start_s=60)
    assert fp8["storage"] == "fp8_e4m3" and 0.50 < fp8["bytes_total"] / plain["bytes_total"] < 0.51
    # per token and layer: 2 x 4096 bytes in bf16, 4096 + a 4-byte scale in FP8 (token ids: 8 bytes a token)
    assert shard_bytes(1, 0, 1, 4096, "bfloat16", fp8_e4m3) - shard_bytes(0, 0, 1, 4096, "bfloat16", model) == 4100 + 8


def test_pass_rule_adds_the_fp8_floor():
    """A capture as far from the reference as FP8 rounding takes it passes only with the FP8 floor;
    twice as far fails with it (the floor run, bf16-like, is 10x smaller)."""
    ref = torch.randn(40, 256, generator=torch.Generator().manual_seed(0))
    bf16 = ref.to(torch.bfloat16).float()
    fp8 = roundtrip_fp8(bf16)  # what a right FP8 capture holds
    tok, ftok, qtok = token_errors(fp8, ref), token_errors(bf16, ref), storage_floor(ref, storage_format("fp8_e4m3"))
    assert not judge_tokens(tok, ftok, "bfloat16")["ok"]  # the plain rule calls FP8 rounding a mistake
    verdict = judge_tokens(tok, ftok, "bfloat16", qtok)
    assert verdict["ok"] and verdict["rel"] < 0.8 * verdict["bound_rel"], verdict
    bound = max(4 * verdict["floor_rel"], 1e-2) + STORAGE_FACTOR * verdict["storage_rel"]
    assert verdict["bound_rel"] == pytest.approx(bound)
    wrong = ref + 2 * (fp8 - ref) + 0.05 * ref.norm(dim=-1, keepdim=True) / 16 * torch.randn_like(ref)
    assert judge_tokens(token_errors(wrong, ref), ftok, "bfloat16", qtok)["criterion"] in ("diverged_tokens", "rel")
