"""Tokenize with images (issue #28 item 2): the tiny Qwen2.5-VL target's image processor decides each image's
vision tokens, the placeholder is expanded to them, the loss mask is 0 there and still exactly the replies,
rows record their images and grids, a cut inside an image is quarantined; text rows keep their bytes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from eagle3prep.demo import build_demo_model

from testkit import calls
from testkit.tiny_vl import build_tiny_vl

ROOT = Path(__file__).resolve().parents[1]
# tokenize's shards and token counts of the demo's prepared conversations (test_prepare_images.DEMO_SHA256) with
# the demo model at max_seq_len 256 in 2 shards, written by main before images were tokenized (c20b8a0)
DEMO_TOKENIZED_SHA256 = {
    "s0.jsonl": "29dc625fe9c8c20f7f006b0bb8d86632b38e98703e575b057ccdd25650b1764b",
    "s1.jsonl": "b0e9685859f658825026b0767db520547e4a6740076d5e8415c92d9207a571bc",
    "tf.json": "175652270cf28437e877092d98db1bcba8dfc59c551538595b0f94cb7cdaaf15",
}
GRIDS = {"red_square.png": [1, 4, 4], "blue_circle.png": [1, 4, 6], "green_bars.png": [1, 6, 8]}


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return build_tiny_vl(tmp_path_factory.mktemp("vl") / "qwen2_5_vl")


def prepared(tmp_path, monkeypatch, records=None) -> Path:
    """resources/demo/vision.jsonl (or `records`) prepared with images under resources/demo/images."""
    monkeypatch.chdir(ROOT)
    src = ROOT / "resources/demo/vision.jsonl"
    if records is not None:
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    out = tmp_path / "prepared"
    calls.prepare(
        [str(src)],
        out / "c.jsonl",
        out / "q.jsonl",
        out / "n.json",
        images=calls.image_options("resources/demo/images"),
    )
    return out / "c.jsonl"


def tokenize(conversations: Path, model: Path, max_seq_len: int = 256):
    out = conversations.parent.parent / "tok"
    stats = calls.tokenize(
        conversations, model, [out / "s0.jsonl"], out / "stats.json", out / "tf.json", out / "q.jsonl", max_seq_len
    )
    rows = [json.loads(x) for x in (out / "s0.jsonl").read_text().splitlines()]
    quarantine = [json.loads(x) for x in (out / "q.jsonl").read_text().splitlines()]
    return stats, rows, quarantine


def test_image_rows_get_vision_tokens_a_reply_mask_and_their_images(tmp_path, monkeypatch, vl_model):
    from transformers import AutoTokenizer

    stats, rows, quarantine = tokenize(prepared(tmp_path, monkeypatch), vl_model)
    assert stats["rows"] == 5 and not quarantine
    # 4 + 6 + 4 + 12 + (4 + 6) vision tokens in 6 images of 5 rows
    assert (stats["image_rows"], stats["images"], stats["image_tokens"]) == (5, 6, 36)
    tok = AutoTokenizer.from_pretrained(vl_model)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    conversations = [json.loads(x) for x in (tmp_path / "prepared/c.jsonl").read_text().splitlines()]
    for row, conv in zip(rows, conversations, strict=True):
        images = [
            p for m in conv["messages"] if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"
        ]
        assert [i["sha256"] for i in row["images"]] == [i["sha256"] for i in images]
        names = [Path(i["image"]).name if not i["image"].startswith("data:") else "red_square.png" for i in images]
        assert row["image_grid_thw"] == [GRIDS[n] for n in names]
        n_vision = sum(t * h * w // 4 for t, h, w in row["image_grid_thw"])
        assert row["input_ids"].count(pad) == n_vision  # the placeholder expanded to the processor's count
        assert all(not m for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if t == pad)
        reply = conv["messages"][-1]["content"] + "<|im_end|>"
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert tok.decode(masked) == reply  # the mask moved with the expansion: exactly the reply
        assert list(row) == ["row", "id", "input_ids", "loss_mask", "seq_len", "images", "image_grid_thw"]
    assert rows[2]["images"][0]["image"] is None  # a data: URI stays in the conversation, found by the row's id


def test_a_cut_inside_an_image_is_quarantined_and_one_after_it_kept(tmp_path, monkeypatch, vl_model):
    record = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                     {"type": "image_url", "image_url": {"url": "green_bars.png"}},
                                     {"type": "text", "text": "How many bars?"}]},
        {"role": "assistant", "content": "Four bars, all green, standing in a row on a white page."}]}  # fmt: skip
    text = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}  # 15 tokens
    conversations = prepared(tmp_path, monkeypatch, [record, text])
    # tokens 0..8 "<|im_start|>user\nLook: ", 9 <|vision_start|>, 10..21 the 12 vision tokens, 22 <|vision_end|>
    for max_seq_len in (14, 17, 22):  # among the vision tokens, and between the last one and <|vision_end|>
        _, rows, quarantine = tokenize(conversations, vl_model, max_seq_len=max_seq_len)
        assert len(rows) == 1 and [q["reason"] for q in quarantine] == ["image_cut_by_max_seq_len"], max_seq_len
        assert "falls inside image 0" in quarantine[0]["detail"] and "\n" not in quarantine[0]["detail"]
    stats, rows, quarantine = tokenize(conversations, vl_model, max_seq_len=40)
    assert not quarantine and stats["truncated_rows"] == 1 and rows[0]["image_grid_thw"] == [[1, 6, 8]]
    assert rows[0]["seq_len"] == 40


def test_an_image_changed_after_prepare_is_quarantined(tmp_path, monkeypatch, vl_model):
    images = tmp_path / "imgs"
    images.mkdir()
    (images / "a.png").write_bytes((ROOT / "resources/demo/images/red_square.png").read_bytes())
    monkeypatch.chdir(ROOT)
    record = {"conversations": [{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "A square."}],
              "images": ["a.png"]}  # fmt: skip
    text = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    (tmp_path / "in.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(text) + "\n")
    out = tmp_path / "prepared"
    calls.prepare(
        [str(tmp_path / "in.jsonl")],
        out / "c.jsonl",
        out / "q.jsonl",
        out / "n.json",
        images=calls.image_options(images),
    )
    (images / "a.png").write_bytes((ROOT / "resources/demo/images/blue_circle.png").read_bytes())
    _, rows, quarantine = tokenize(out / "c.jsonl", vl_model)
    assert len(rows) == 1 and [q["reason"] for q in quarantine] == ["image_changed"]
    assert "is not the image prepare read (sha256 differs)" in quarantine[0]["detail"]


def test_text_that_writes_a_vision_placeholder_is_quarantined_at_tokenize(tmp_path, monkeypatch, vl_model):
    """A text row (or an image row's text) on a VLM target that writes <|image_pad|> or <|video_pad|> itself
    would stop the extract job in the engine, after the GPU job started: tokenize quarantines it, with the
    token's position, and keeps the rows around it."""
    text = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    pad_in_reply = {
        "messages": [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": "x<|image_pad|>"}]
    }
    video_in_prompt = {"messages": [{"role": "user", "content": "<|video_pad|> what is this?"},
                                    {"role": "assistant", "content": "A clip."}]}  # fmt: skip
    image_row_with_pad = {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "red_square.png"}},
                                     {"type": "text", "text": "and <|video_pad|>?"}]},
        {"role": "assistant", "content": "A square."}]}  # fmt: skip
    records = [text, pad_in_reply, video_in_prompt, image_row_with_pad]
    stats, rows, quarantine = tokenize(prepared(tmp_path, monkeypatch, records), vl_model)
    assert stats["rows"] == 1 and rows[0]["id"] and "images" not in rows[0]
    assert [(q["line"], q["reason"]) for q in quarantine] == [(2, "media_token_in_text"), (3, "media_token_in_text"),
                                                               (4, "media_token_in_text")]  # fmt: skip
    assert "image_token_id = " in quarantine[0]["detail"] and "video_token_id = " in quarantine[1]["detail"]
    assert "at token " in quarantine[2]["detail"] and "\n" not in quarantine[2]["detail"]


def test_a_vision_placeholder_past_max_seq_len_is_cut_with_the_row_not_quarantined(tmp_path, monkeypatch, vl_model):
    late = {"messages": [{"role": "user", "content": "Hi?"},
                         {"role": "assistant", "content": "Hello there, " * 20 + "<|image_pad|>"}]}  # fmt: skip
    text = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    conversations = prepared(tmp_path, monkeypatch, [late, text])
    stats, rows, quarantine = tokenize(conversations, vl_model, max_seq_len=40)
    assert not quarantine and stats["truncated_rows"] == 1 and rows[0]["seq_len"] == 40
    _, rows, quarantine = tokenize(conversations, vl_model, max_seq_len=256)  # kept whole: the token is in
    assert len(rows) == 1 and [q["reason"] for q in quarantine] == ["media_token_in_text"]


def test_a_text_only_target_quarantines_image_rows_and_keeps_text_rows(tmp_path, monkeypatch):
    model = build_demo_model(tmp_path / "demo", ROOT / "resources/demo/tokenizer_corpus.txt")
    text = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    with_image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "red_square.png"}}]},
                               {"role": "assistant", "content": "A square."}]}  # fmt: skip
    stats, rows, quarantine = tokenize(prepared(tmp_path, monkeypatch, [text, with_image]), model)
    assert stats["rows"] == 1 and [q["reason"] for q in quarantine] == ["images_unsupported_by_target"]
    assert "has no vision tower" in quarantine[0]["detail"] and "images" not in rows[0]
    assert "image_rows" not in stats


def test_text_only_demo_tokenizes_to_the_bytes_it_gave_before_images(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    model = build_demo_model(tmp_path / "demo", ROOT / "resources/demo/tokenizer_corpus.txt")
    sources = [f"resources/demo/{n}" for n in ("sharegpt.jsonl", "openai.jsonl", "sharegpt.parquet", "openai.parquet")]
    p = tmp_path / "prepared"
    calls.prepare(
        sources,
        p / "c.jsonl",
        p / "q.jsonl",
        p / "n.json",
        images=calls.image_options(),
    )
    t = tmp_path / "tok"
    calls.tokenize(
        p / "c.jsonl", model, [t / "s0.jsonl", t / "s1.jsonl"], t / "stats.json", t / "tf.json", t / "q.jsonl", 256
    )
    assert {
        n: hashlib.sha256((t / n).read_bytes()).hexdigest() for n in DEMO_TOKENIZED_SHA256
    } == DEMO_TOKENIZED_SHA256


def test_worker_processes_give_the_same_rows(tmp_path, monkeypatch, vl_model):
    conversations = prepared(tmp_path, monkeypatch)
    out = {}
    for workers in (1, 2):  # images are decoded and processed in the workers
        t = tmp_path / f"w{workers}"
        calls.tokenize(
            conversations,
            vl_model,
            [t / "s0.jsonl"],
            t / "stats.json",
            t / "tf.json",
            t / "q.jsonl",
            256,
            batch_size=2,
            workers=workers,
        )
        out[workers] = (t / "s0.jsonl").read_bytes()
    assert out[1] == out[2]


@pytest.mark.integration
def test_the_workflow_takes_the_demo_images_through_hf_extract_to_validation_pass(tmp_path, vl_model):
    from testkit.workflow import make_workdir, snakemake

    config = {
        "data": {"sources": ["resources/demo/vision.jsonl"], "image_root": "resources/demo/images"},
        "model": {"path": str(vl_model)},
        "tokenize": {"max_seq_len": 128, "num_shards": 1},
        "extract": {"backend": "hf", "dtype": "bfloat16", "threads": 1},
    }
    work = make_workdir(tmp_path / "work", config)
    snakemake(work, "--cores", "1", "results/validation/shard_0.json")
    counts = json.loads((work / "results/prepared/counts.json").read_text())
    stats = json.loads((work / "results/tokenized/stats.json").read_text())
    assert (counts["totals"]["kept"], counts["totals"]["images"]) == (5, 6)
    assert (stats["rows"], stats["image_rows"], stats["images"]) == (5, 5, 6)
    report = json.loads((work / "results/validation/shard_0.json").read_text())
    assert report["ok"] and report["reference_sample"]["rows"] == 5 and report["tokens"] == stats["tokens"]
    assert [c["check"] for c in report["checks"] if c["check"].startswith("reference:")]  # recomputed with pixels


def test_the_render_boundary_mask_moves_with_the_expansion_too(tmp_path, monkeypatch, vl_model):
    import shutil

    from transformers import AutoTokenizer

    # the same target with a template without {% generation %}: the mask comes from the render boundary
    model = tmp_path / "no_markers"
    shutil.copytree(vl_model, model)
    template = (model / "chat_template.jinja").read_text()
    template = template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    (model / "chat_template.jinja").write_text(template)
    stats, rows, quarantine = tokenize(prepared(tmp_path, monkeypatch), model)
    assert stats["mask_source"] == "render_boundary" and stats["rows"] == 5 and not quarantine
    tok = AutoTokenizer.from_pretrained(model)
    conversations = [json.loads(x) for x in (tmp_path / "prepared/c.jsonl").read_text().splitlines()]
    for row, conv in zip(rows, conversations, strict=True):
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert tok.decode(masked).startswith(conv["messages"][-1]["content"])


def test_an_image_met_before_is_not_processed_again(monkeypatch, vl_model):
    """Vision.grids: regenerate renders a conversation's images again at every turn; the image processor runs once
    per distinct image (its sha256), the grids are the processor's, and the memory is bounded (GRID_CACHE)."""
    from transformers import AutoTokenizer

    from eagle3prep.tokenize import vision

    v = vision.load_vision(vl_model, AutoTokenizer.from_pretrained(vl_model))
    calls, real = [], v.image_processor

    def counting(images):
        calls.append(len(images))
        return real(images=images)

    v.image_processor = lambda images: counting(images)
    folder = ROOT / "resources/demo/images"
    parts = [
        {"image": str(folder / n), "sha256": hashlib.sha256((folder / n).read_bytes()).hexdigest()} for n in GRIDS
    ]
    pils = vision.load_images(parts)
    assert v.grids(parts[:2], pils[:2]) == [GRIDS["red_square.png"], GRIDS["blue_circle.png"]]
    assert v.grids(parts, pils) == list(GRIDS.values())  # the next turn: one new image
    assert v.grids(parts, pils) == list(GRIDS.values())
    assert calls == [2, 1]
    monkeypatch.setattr(vision, "GRID_CACHE", 1)
    assert v.grids(parts[:1], pils[:1]) == [GRIDS["red_square.png"]]
    assert list(v._grids) == [parts[0]["sha256"]]  # the newest kept
    assert v.grids(parts[1:2], pils[1:2]) == [GRIDS["blue_circle.png"]] and calls == [2, 1, 1]
