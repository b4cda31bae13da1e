"""The tiny offline vision-language target (issue #28 item 5) and the demo's synthetic images: built with no
download, byte-identical on every build, loaded back by transformers' Auto classes, its image tokens counted
as Qwen2.5-VL's processor counts them; the committed images and vision.jsonl are what the module writes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from eagle3prep.prepare import prepare
from eagle3prep.prepare.images import ImageOptions

from testkit.tiny_vl import (
    IMAGES,
    build_tiny_vl,
    expand_image_tokens,
    image_bytes,
    model_inputs,
    probe_messages,
    vision_records,
)

ROOT = Path(__file__).resolve().parents[1]
DEMO_IMAGES = ROOT / "resources" / "demo" / "images"
# (t, h, w) patch grid of each image at the tiny processor's resolutions, and its vision tokens (t*h*w / 2**2)
GRIDS = {"red_square.png": ((1, 4, 4), 4), "blue_circle.png": ((1, 4, 6), 6), "green_bars.png": ((1, 6, 8), 12)}


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_tiny_vl(tmp_path_factory.mktemp("vl") / "qwen2_5_vl")


def test_build_is_byte_identical(built, tmp_path):
    again = build_tiny_vl(tmp_path / "again")
    assert digests(built) == digests(again)
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= set(digests(built))


def test_auto_classes_load_it_and_images_get_their_vision_tokens(built):
    import torch
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    config = AutoConfig.from_pretrained(built)
    assert config.model_type == "qwen2_5_vl" and config.text_config.num_hidden_layers == 6
    tokenizer, image_processor = AutoTokenizer.from_pretrained(built), AutoImageProcessor.from_pretrained(built)
    model = AutoModelForImageTextToText.from_pretrained(built).eval()
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert pad == config.image_token_id and pad != tokenizer.unk_token_id
    last = {}
    for name, (grid, n_tokens) in GRIDS.items():
        image = Image.open(DEMO_IMAGES / name)
        inputs = model_inputs(tokenizer, image_processor, probe_messages(image), [image])
        assert inputs["image_grid_thw"].tolist() == [list(grid)]
        assert int((inputs["input_ids"] == pad).sum()) == n_tokens
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True)
        assert len(out.hidden_states) == 7 and torch.isfinite(out.logits).all()
        last[name] = out.hidden_states[-1][0, -1]
    # the image reaches the text: the same prompt ends in a different state for a different picture
    assert not torch.allclose(last["red_square.png"], last["blue_circle.png"])


def test_chat_template_renders_image_parts_and_marks_the_reply(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    messages = probe_messages("red_square.png")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>" in text
    enc = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(masked) == "A red square on a white page.<|im_end|>"


def test_expand_image_tokens_refuses_a_count_mismatch():
    assert expand_image_tokens("a<|image_pad|>b", [(1, 2, 4)]) == "a" + "<|image_pad|>" * 2 + "b"
    with pytest.raises(ValueError, match="1 <|image_pad|> in the text, 2 images"):
        expand_image_tokens("a<|image_pad|>b", [(1, 2, 2), (1, 2, 2)])


def test_committed_images_and_records_are_what_the_module_writes():
    assert sorted(p.name for p in DEMO_IMAGES.iterdir()) == sorted(IMAGES)
    for name in IMAGES:
        assert (DEMO_IMAGES / name).read_bytes() == image_bytes(name), (
            "re-run PYTHONPATH=tests python -m testkit.tiny_vl"
        )
    lines = (ROOT / "resources/demo/vision.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(x) for x in lines] == vision_records()


def test_demo_vision_records_prepare_as_planted(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    counts = prepare(
        ["resources/demo/vision.jsonl"], out / "c.jsonl", out / "q.jsonl", out / "n.json",
        images=ImageOptions("resources/demo/images", max_pixels=4096 * 4096), max_line_bytes=1 << 24, allow_no_user_turn=False,
    )  # fmt: skip
    t = counts["totals"]
    assert (t["rows_in"], t["kept"], t["duplicates"], t["images"]) == (10, 5, 1, 6)
    assert {r: n for r, n in t["quarantined"].items() if n} == {
        "image_missing": 1, "image_remote_url": 1, "image_unreadable": 1, "image_count_mismatch": 1,
    }  # fmt: skip
