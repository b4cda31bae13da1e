"""Extract and validate rows with images (issue #28 items 3, hf backend, and 4) on the tiny Qwen2.5-VL at two
seeds: the hf backend captures every position, image positions included, from pixels re-made from the rows'
recorded images; validation recomputes them with the processor's pixels and passes right data; each planted
image mistake fails it; the scalable checks run on image rows at their 3-D rope positions."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3prep.errors import UserError
from eagle3prep.extract import extract_shard
from eagle3prep.settings import ExtractSettings, ValidateSettings
from eagle3prep.tokenize.row_inputs import RowImages
from eagle3prep.validate import ValidateJobSettings, ValidatePaths, ValidationError, run_validate_job

from testkit.image_rows import chat, tokenize_records
from testkit.planted import IMAGE_MISTAKES, plant_image
from testkit.shards import capture_spec, with_settings
from testkit.tiny_vl import build_tiny_vl, image_bytes

LAYERS = [1, 3, 6]  # an early id, a middle one and N (the pre-norm final state)


def other_square() -> bytes:
    """A 56 x 56 image like red_square.png (the same grid) with other pixels: a pair to swap."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (56, 56), (20, 20, 20))
    ImageDraw.Draw(img).ellipse((4, 4, 52, 52), fill=(250, 210, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def records(images: Path) -> list[dict]:
    for name in ("red_square.png", "green_bars.png"):
        (images / name).write_bytes(image_bytes(name))
    (images / "yellow_disc.png").write_bytes(other_square())
    uri = "data:image/png;base64," + base64.b64encode(image_bytes("blue_circle.png")).decode("ascii")
    return [
        chat(["red_square.png"], "What shape is in the picture?", "A red square on a white page."),
        chat([], "Name a colour.", "Blue."),
        chat(["yellow_disc.png"], "What shape is in the picture?", "A yellow disc on black."),
        chat([uri], "What colour is the circle?", "The circle is blue."),  # a data: URI, kept in the conversation
        chat(["green_bars.png"], "How many bars are there?", "There are four green bars."),
    ]


@pytest.fixture(scope="module", params=[0, 1], ids=["seed0", "seed1"])
def captured(request, tmp_path_factory):
    """The tiny Qwen2.5-VL at one seed, the rows above tokenized into one shard, captured by hf in bf16."""
    root = tmp_path_factory.mktemp(f"vl{request.param}")
    model = build_tiny_vl(root / "model", seed=request.param)
    (root / "images").mkdir()
    (shard,) = tokenize_records(records(root / "images"), model, root, 256)
    spec = capture_spec(
        backend="hf", model_path=str(model), layer_ids=LAYERS, dtype="bfloat16", max_seq_len=256, device="cpu",
        tp_size=1,
    )  # fmt: skip
    settings = ExtractSettings.defaults(logprob_rows=5, batch_tokens=128)  # several batches
    extract_shard(str(shard), str(root / "hs"), with_settings(spec, settings), 0, 1)
    rows = [json.loads(x) for x in shard.read_text().splitlines()]
    return SimpleNamespace(root=root, model=str(model), shard=shard, hs=root / "hs", rows=rows)


def validate(c, shard_dir: Path, **kw):
    settings = ValidateJobSettings(ValidateSettings.defaults(**kw), trust_remote_code=False, keep_failed=False)
    return run_validate_job(ValidatePaths(str(shard_dir), str(c.shard), str(c.root / "v.json"), c.model), settings)


def test_hf_captures_image_rows_and_validation_passes_right_data(captured):
    from eagle3prep.shard.readers import read_index, read_layer

    assert [bool(r.get("images")) for r in captured.rows] == [True, False, True, True, True]
    assert captured.rows[3]["images"][0]["image"] is None  # re-made from the conversation's data: URI
    report = validate(captured, captured.hs)
    assert report["ok"] and report["reference_sample"]["rows"] == 5
    assert {c["check"] for c in report["checks"]} >= {f"reference:layer_{lid}" for lid in LAYERS}
    index, tokens = read_index(captured.hs), read_layer(captured.hs / "layer_6.safetensors")
    assert tokens.shape[0] == sum(r["seq_len"] for r in captured.rows) == index[-1].offset + index[-1].length


@pytest.mark.parametrize("mistake", IMAGE_MISTAKES)
def test_each_planted_image_mistake_fails_validation(captured, mistake):
    out = plant_image(mistake, captured.hs, captured.root / mistake, captured.shard, captured.model)
    with pytest.raises(ValidationError) as e:
        validate(captured, out)
    assert set(e.value.failed) == {f"reference:layer_{lid}" for lid in LAYERS}, e.value
    wrong = 2 if mistake == "images_swapped" else 4  # the swapped pair; every image row
    assert f"{wrong} of 5 rows fail" in str(e.value)


def test_scalable_checks_run_on_image_rows_at_their_rope_positions(captured):
    from eagle3prep.shard.readers import read_index, read_layer
    from eagle3prep.validate.window import check_window

    report = validate(captured, captured.hs, reference="scalable", windows=[[1, 3], [3, 6]])
    checks = {c["check"]: c for c in report["checks"]}
    assert report["ok"] and {"window:1-3", "window:3-6", "logits"} <= set(checks)
    assert "5 rows: final norm" in checks["logits"]["detail"]
    # the same window from 0..T-1 positions (a text row's) fails the image rows: the 3-D positions are what passes
    index, images = read_index(captured.hs), [i for i, r in enumerate(captured.rows) if r.get("images")]
    a, b = (read_layer(captured.hs / f"layer_{k}.safetensors").float() for k in (1, 3))
    rows_a = [a[index[i].offset : index[i].offset + index[i].length] for i in images]
    rows_b = [b[index[i].offset : index[i].offset + index[i].length] for i in images]
    flat = check_window(captured.model, rows_a, rows_b, 1, 3, "bfloat16")
    assert not any(v["ok"] for v in flat)
    positions = [RowImages(captured.model, captured.shard).positions(captured.rows[i]) for i in images]
    assert all(v["ok"] for v in check_window(captured.model, rows_a, rows_b, 1, 3, "bfloat16", positions=positions))


def test_a_row_whose_image_or_grid_changed_stops_in_one_line(captured, tmp_path):
    row = dict(captured.rows[0])
    images = RowImages(captured.model, captured.shard)
    bad = {**row, "image_grid_thw": [[1, 4, 6]]}
    with pytest.raises(UserError, match=r"shard_0\.jsonl: row 0, field image_grid_thw: the image processor gives"):
        images.pixels(bad)
    bad = {**row, "images": [{**row["images"][0], "sha256": "0" * 64}]}
    with pytest.raises(UserError, match=r"row 0, field images: image 0: .* is not the image prepare read"):
        images.pixels(bad)
    bad = {**row, "input_ids": row["input_ids"][:5] + row["input_ids"][6:]}  # one image token lost
    with pytest.raises(UserError, match=r"row 0, field input_ids: 3 image tokens for images of 4 vision tokens"):
        images.pixels(bad)
    lone = tmp_path / "shard_0.jsonl"  # a tokenized shard without its stats.json: the data: URI cannot be found
    with pytest.raises(UserError, match=r"row 3, field images: image 0 is a data: URI kept in the conversation"):
        RowImages(captured.model, lone).pixels(captured.rows[3])


def test_backends_that_cannot_take_images_refuse_them_in_one_line(captured):
    from eagle3prep.shard import index_of_tokenized

    # every backend of the package feeds images now (vllm: tests/test_vllm_images.py); one that does not refuses
    with pytest.raises(UserError, match=r"row 0 has images; extract.backend other does not feed images") as e:
        index_of_tokenized(captured.shard, "other")
    assert "\n" not in str(e.value)
    for backend in ("hf", "vllm"):
        assert [e.row for e in index_of_tokenized(captured.shard, backend)] == [0, 1, 2, 3, 4]
