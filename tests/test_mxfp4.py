"""MXFP4 storage (extract.storage: mxfp4) and the format registry (shard/formats.py): the codec's grid, packing,
scales, NaN and zero blocks, the rounding draw, the layer file and its reader, the manifest and the parse-time
refusal of a hidden size without whole blocks.

Capture, corruption, validation and the planted mistakes on MXFP4 shards are tested beside their model-dtype and
FP8 twins: test_sink, test_corruption, test_validation_matrix, test_vllm_backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3prep.shard import formats, mxfp4
from eagle3prep.shard.formats import DTYPES
from eagle3prep.shard.manifest import ShardManifest
from eagle3prep.shard.readers import LayerReader
from eagle3prep.validate.passrule import token_errors

from testkit.writers import write_layer

MX = formats.storage_format("mxfp4")


def gaussian(tokens: int = 64, hidden: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=g) * torch.logspace(-3, 3, tokens)[:, None]).to(torch.bfloat16)


def test_every_e2m1_value_times_a_power_of_two_is_stored_exactly():
    grid = torch.tensor(mxfp4.E2M1)
    row = torch.cat([grid, -grid, grid, -grid]) * 2.0**-3  # 32 values: one block, amax 6 * 2^-3
    packed, scales = mxfp4.quantize_mxfp4(row[None])
    assert torch.equal(mxfp4.dequantize_mxfp4(packed, scales), row[None])
    assert int(scales[0, 0]) == 127 - 3  # e8m0: 2^(b - 127)
    # element 2i in the low nibble, 2i + 1 in the high one; bit 3 is the sign
    assert int(packed[0, 0]) == (1 << 4) | 0 and int(packed[0, 4]) == (0b1001 << 4) | 0b1000  # -0.0 keeps its sign


def e2m1_nearest_even(y: float) -> int:
    """The e2m1 code of `y` (|y| <= 6) by the definition: the nearest magnitude, at a tie the even code."""
    mag = min(range(8), key=lambda c: (abs(abs(y) - mxfp4.E2M1[c]), c % 2))
    return mag | (8 if str(y).startswith("-") else 0)


def grid_rows() -> torch.Tensor:
    """Every multiple of 2^-8 in [-6, 6] (ties and all) in blocks led by 6.0: each block's scale is 2^0."""
    y = torch.arange(-6 * 256, 6 * 256 + 1) / 256.0
    y = torch.cat([y, torch.tensor([-0.0, 1e-30, -1e-30])])
    y = torch.cat([y, torch.zeros(-len(y) % 31)]).view(-1, 31)
    return torch.cat([torch.full((len(y), 1), 6.0), y], dim=1).reshape(1, -1)


def test_rounding_is_to_nearest_with_ties_to_even():
    x = grid_rows()
    packed, scales = mxfp4.quantize_mxfp4(x)
    assert bool((scales == 127).all())
    want = torch.tensor([e2m1_nearest_even(v) for v in x[0].tolist()], dtype=torch.uint8)
    assert torch.equal(mxfp4.codes_of(packed)[0], want)
    assert int(mxfp4.codes_of(mxfp4.quantize_mxfp4(torch.tensor([[6.0] + [2.5] * 31]))[0])[0, 1]) == 4  # 2.5 -> 2


def test_codes_are_ml_dtypes_float4_e2m1fn():
    """The values over their block scale, encoded by ml_dtypes (OCP's round to nearest even), give the same codes:
    on the exhaustive grid and on Gaussian rows of every magnitude."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (envs/gpu.txt) is not installed here")
    import numpy as np

    for x in (grid_rows(), gaussian(64, 4096, seed=4)):
        packed, scales = mxfp4.quantize_mxfp4(x)
        y = x.float().view(len(x), -1, 32) / mxfp4.scale_values(scales)
        theirs = y.reshape(len(x), -1).numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
        assert np.array_equal(mxfp4.codes_of(packed).numpy(), theirs)


def test_the_scale_is_rounded_up_so_no_value_clips():
    x = gaussian()
    x[0, 5] = 1000.0  # an outlier: it must come back as itself (within e2m1's step), not clipped to 6 x scale
    back = MX.roundtrip(x)
    assert float(back[0, 5]) == pytest.approx(1000.0, rel=0.25) and float(back[0, 5]) >= 768.0
    e = mxfp4.block_exponents(x.float())
    amax = x.float().abs().view(len(x), -1, 32).amax(-1)
    assert bool((amax <= 6 * torch.exp2(e.float())).all())  # every block fits under its scale...
    assert bool((amax[amax > 0] > 3 * torch.exp2(e.float())[amax > 0]).all())  # ...and no smaller scale would do


def test_error_is_e2m1s_and_the_bytes_are_a_quarter_of_bf16s_plus_the_scales():
    x = gaussian(hidden=4096, seed=1)
    err = token_errors(MX.roundtrip(x), x.float())
    assert 0.08 < float(err.mean()) < 0.14 and float(err.max()) < 0.16  # ~12 % a token on Gaussian rows
    assert MX.token_bytes(4096, "bfloat16") == 2048 + 128  # 4-bit values, one byte a 32-value block
    four_layers = 4 * MX.token_bytes(4096, "bfloat16") + 8
    assert four_layers / (4 * 2 * 4096 + 8) == pytest.approx(0.2658, abs=1e-4)


def test_a_nan_or_inf_block_reads_back_nan_and_a_zero_block_as_zero():
    x = gaussian(4)
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    x[3] = 0.0
    packed, scales = mxfp4.quantize_mxfp4(x)
    back = mxfp4.dequantize_mxfp4(packed, scales)
    assert int(scales[1, 1]) == int(scales[2, 0]) == mxfp4.SCALE_NAN
    assert bool(back[1, 32:64].isnan().all()) and bool(back[1, :32].isfinite().all())  # that block only
    assert bool(back[2, :32].isnan().all()) and bool((back[3] == 0).all())


def test_bfloat16_decode_is_the_float32_decode_rounded_and_exact():
    x = gaussian(hidden=256, seed=2)
    packed, scales = mxfp4.quantize_mxfp4(x)
    f32 = mxfp4.dequantize_mxfp4(packed, scales)
    bf16 = mxfp4.dequantize_mxfp4(packed, scales, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16.float(), f32)  # e2m1 x 2^k is exact in bf16


def test_a_rounding_draw_stays_in_its_codes_interval():
    x = gaussian(hidden=256, seed=3).float()
    stored = MX.roundtrip(x)
    draw = MX.draw(stored, torch.Generator().manual_seed(1))
    e = mxfp4.block_exponents(stored).float()
    step = torch.exp2(e).repeat_interleave(32, dim=1)  # the largest gap of e2m1 (4 -> 6) is 2 x scale
    assert bool(((draw - stored).abs() <= step).all())
    again = MX.roundtrip(draw)
    assert float((again == stored).float().mean()) > 0.95  # back on the stored value (a block's scale may move)
    assert 0.3 < float(token_errors(draw, stored).mean()) / float(token_errors(stored, x).mean()) < 1.5


def test_layer_file_and_reader(tmp_path):
    x = gaussian(20, 64)
    write_layer(tmp_path / "mx.safetensors", x, "mxfp4")
    reader = LayerReader(tmp_path / "mx.safetensors")
    assert reader.format is MX and reader.shape == [20, 64] and not reader.format.exports_scales
    assert reader.tensors() == {"hidden_states": ("U8", [20, 32]), "hidden_states_scales": ("U8", [20, 2])}
    assert torch.equal(reader.rows(3, 9, torch.float32), MX.roundtrip(x)[3:9])
    assert reader.rows(3, 9).dtype == torch.bfloat16  # what trainers read
    size = (tmp_path / "mx.safetensors").stat().st_size
    assert size - 20 * (32 + 2) < 2048  # values, scales, the header with its metadata


def test_a_layer_file_describes_itself(tmp_path):
    """The safetensors metadata names the format, the model and stored dtypes, the packing, the scales and the
    rounding: a reader needs no manifest. A file without metadata (written before) is read by its tensors."""
    from safetensors import safe_open

    x = gaussian(8, 64)
    write_layer(tmp_path / "mx.safetensors", x, "mxfp4")
    with safe_open(str(tmp_path / "mx.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["storage"] == "mxfp4" and meta["format"] == formats.FORMAT_MXFP4
    assert meta["model_dtype"] == "bfloat16" and meta["stored_dtype"] == "uint8"
    assert "low nibble" in meta["packing"] and "e8m0" in meta["scales"] and "ties to even" in meta["rounding"]
    assert LayerReader(tmp_path / "mx.safetensors").metadata == meta
    for name in formats.STORAGES:  # every format names itself and its rounding
        m = formats.storage_format(name).metadata("bfloat16")
        assert m["storage"] == name and "rounding" in m and all(isinstance(v, str) for v in m.values())
    old = tmp_path / "old.safetensors"
    raw = (tmp_path / "mx.safetensors").read_bytes()
    from eagle3prep.shard.layout import safetensors_header

    layout = [("hidden_states", "uint8", (8, 32)), ("hidden_states_scales", "uint8", (8, 2))]
    old.write_bytes(safetensors_header(layout) + raw[-8 * 34 :])  # no metadata
    reader = LayerReader(old)
    assert reader.metadata == {} and reader.format is MX
    assert torch.equal(
        reader.rows(0, 8, torch.float32), LayerReader(tmp_path / "mx.safetensors").rows(0, 8, torch.float32)
    )


def test_metadata_that_contradicts_the_tensors_is_refused(tmp_path):
    from eagle3prep.shard.layout import safetensors_header

    path = tmp_path / "layer_3.safetensors"
    layout = [("hidden_states", "uint8", (8, 32)), ("hidden_states_scales", "uint8", (8, 2))]
    metadata = formats.storage_format("model_dtype").metadata("bfloat16")
    path.write_bytes(safetensors_header(layout, metadata) + bytes(8 * 34))
    with pytest.raises(ValueError, match=r"layer_3.safetensors: its metadata names storage 'model_dtype'"):
        LayerReader(path)


def test_the_manifest_names_the_model_and_the_stored_dtype_apart():
    from test_fp8 import read_manifest_fields

    m = {**read_manifest_fields(), "format": formats.FORMAT_MXFP4, "storage": MX.entry}
    old = ShardManifest.from_json(m)  # a manifest written before stored_dtype: derived from its format
    assert old.dtype == "float32" and old.stored_dtype == "uint8"
    new = ShardManifest.from_json({**m, "dtype": "bfloat16", "stored_dtype": "uint8"}).to_json()
    assert new["dtype"] == "bfloat16" and new["stored_dtype"] == "uint8" and new["storage"]["rounding"]
    assert ShardManifest.from_json(read_manifest_fields()).stored_dtype == "float32"  # model dtype: as computed


def test_the_registry_knows_every_storage_the_schema_offers():
    import yaml

    from eagle3prep.config import SCHEMA

    schema = yaml.safe_load(Path(SCHEMA).read_text(encoding="utf-8"))
    assert schema["properties"]["extract"]["properties"]["storage"]["enum"] == list(formats.STORAGES)
    for fmt in formats.FORMATS.values():
        for _, dtype, _ in fmt.tensors(3, 4096, "bfloat16"):
            assert dtype in DTYPES
        assert (fmt.entry.get("name", "model_dtype")) == fmt.name  # the manifest names the format it holds
    assert len({f.mark for f in formats.FORMATS.values()}) == len(formats.FORMATS)


def test_each_format_answers_the_exports_questions_and_travels_by_name():
    """speculators reads FP8 values and scales itself; it reads no 4-bit, so an MXFP4 export copy is decoded (and
    billed) in the model dtype. A format pickles as its name: the one another process resolves is the same row."""
    import pickle

    plain, fp8, mx = (formats.storage_format(n) for n in ("model_dtype", "fp8_e4m3", "mxfp4"))
    assert [f.speculators_backend for f in (plain, fp8, mx)] == ["file", "fp8", "file"]
    assert [f.exports_scales for f in (plain, fp8, mx)] == [False, True, False]
    assert (plain.export_copy, fp8.export_copy, mx.export_copy) == (plain, fp8, plain)
    assert (plain.manifest_entry, fp8.manifest_entry) == (None, fp8.entry)
    assert all(pickle.loads(pickle.dumps(f)) is f for f in formats.FORMATS.values())
    assert formats.storage_of_entry(None) == "model_dtype" and formats.storage_of_entry(mx.entry) == "mxfp4"


def test_manifest_format_and_storage_must_agree():
    from test_fp8 import read_manifest_fields

    m = read_manifest_fields()
    mx = {**m, "format": formats.FORMAT_MXFP4, "storage": MX.entry}
    assert ShardManifest.from_json(mx).storage_format is MX
    with pytest.raises(ValueError, match="with storage 'mxfp4'"):
        ShardManifest.from_json({**mx, "format": formats.FORMAT_FP8})
    with pytest.raises(ValueError, match="format 'eagle3prep.hidden_states/9'"):
        ShardManifest.from_json({**mx, "format": "eagle3prep.hidden_states/9"})


def test_a_hidden_size_without_whole_blocks_is_refused_at_parse_time(tmp_path, demo_model_dir):
    import json
    import shutil

    from eagle3prep.config import ConfigError
    from eagle3prep.run.parse import check_model_files
    from eagle3prep.settings import Settings

    model = tmp_path / "model"
    shutil.copytree(demo_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "hidden_size": 100}))
    data = {"sources": ["chats.jsonl"]}
    settings = Settings.validated({"data": data, "model": {"path": str(model)}, "extract": {"storage": "mxfp4"}})
    with pytest.raises(ConfigError, match="extract.storage = mxfp4: mxfp4 storage needs a hidden size that is a "
                                          "multiple of 32; this model's is 100"):  # fmt: skip
        check_model_files(settings)
    check_model_files(
        Settings.validated({"data": data, "model": {"path": str(model)}, "extract": {"storage": "fp8_e4m3"}})
    )


def test_the_validation_line_says_how_much_of_the_bound_is_the_formats_own_floor():
    """A passed layer's line on an MXFP4 shard names the share of its bound that MXFP4's own floor makes; on a
    model-dtype shard no share is claimed."""
    from eagle3prep.validate.passrule import judge_layer, judge_row
    from eagle3prep.validate.recompute import _layer_summary, reference_ok_detail

    ref = gaussian(16, 256, seed=5).float()
    mx_rows = [{"row": 0, "layer_id": 2, **judge_row(MX.roundtrip(ref), ref, None, "float32", MX)}]
    plain_rows = [{"row": 0, "layer_id": 2, **judge_row(ref.clone(), ref, None, "float32")}]
    for rows in (mx_rows, plain_rows):
        judge_layer(rows)
    mx, plain = _layer_summary(mx_rows), _layer_summary(plain_rows)
    assert 0.9 < mx["storage_share"] <= 1.0 and plain["storage_share"] == 0.0  # fp32 exact: the bound is MXFP4's
    line = reference_ok_detail(mx)
    assert f"{mx['storage_share']:.0%} of that bound is the MXFP4 format's own floor" in line
    assert "own floor" not in reference_ok_detail(plain)


def test_the_reports_storage_floor_names_the_format():
    from types import SimpleNamespace

    from eagle3prep.validate.stage import _storage_floor

    text = _storage_floor(SimpleNamespace(scaled=MX))
    assert text.startswith("the MXFP4 format's own floor") and "1.5x its error" in text
