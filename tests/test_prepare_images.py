"""Conversations with images in the prepare stage (issue #28 item 1): OpenAI image parts (data: URIs, paths,
file:// URLs under data.image_root), LLaVA/ShareGPT <image> markers, ids by image bytes, and one quarantine
reason per kind of bad image. Images are drawn with Pillow here; nothing is downloaded."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image, ImageDraw

from eagle3prep.config import validate_config
from eagle3prep.prepare import IMAGE_REASONS, REASONS, check_invariant, conversation_id, normalize
from eagle3prep.prepare.images import ImageOptions
from eagle3prep.settings import IMAGE_KEYS, DataSettings
from eagle3prep.tokenize.rows import parse_conversation
from eagle3prep.tokenize.template import TokenizeError

from testkit import calls

ROOT = Path(__file__).resolve().parents[1]
DEMO = [f"resources/demo/{n}" for n in ("sharegpt.jsonl", "openai.jsonl", "sharegpt.parquet", "openai.parquet")]
# sha256 of prepare's outputs on the demo sources, written by main before images were read (c20b8a0):
# text-only data must give the same bytes with images on. Changing resources/demo changes these.
DEMO_SHA256 = {
    "conversations.jsonl": "90b1d83e8709123387e0a92ae61d0bc673cee53792635d074aadafd16dd858b2",
    # the two invalid_json details read "starting at column", no longer "at at column"; nothing else moved
    "quarantine.jsonl": "015b16d415c7aa293a1f36417e1f297ad61cb4ed967b5b5253446a318b1ee0a6",
    "counts.json": "cd1a7c74e94d3a9b05dfdf0ea285212c2b6450d22f08206b2dd019e37f485538",
}


def png(color=(200, 30, 30), size=(16, 12), fmt="PNG", **save) -> bytes:
    """A small image with a shape on it, encoded as `fmt`."""
    img = Image.new("RGB", size, (255, 255, 255))
    ImageDraw.Draw(img).rectangle([2, 2, size[0] - 3, size[1] - 3], fill=color)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return buf.getvalue()


def data_uri(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def oai(*parts, answer="A red box."):
    """An OpenAI record whose user message is `parts` (strings become text parts, others image_url parts)."""
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": p[0]}}
        for p in parts
    ]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}


def llava(text="<image>\nWhat is this?", images=None, answer="A red box.", key="images"):
    record = {"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": answer}]}
    if images is not None:
        record[key] = images
    return record


@pytest.fixture
def imgdir(tmp_path):
    """An image root with red.png, blue.png, a JPEG and a WEBP."""
    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    (root / "red.png").write_bytes(png())
    (root / "blue.png").write_bytes(png((30, 30, 200)))
    (root / "sub" / "green.jpg").write_bytes(png((30, 200, 30), fmt="JPEG"))
    (root / "pic.webp").write_bytes(png(fmt="WEBP"))
    return root


@pytest.fixture
def run(tmp_path):
    """prepare on records (written as one JSONL file) with images read under `root`; (counts, kept, quarantine)."""

    def _run(records, root=None, **data_keys):
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        out = tmp_path / "out"
        counts = calls.prepare(
            [str(src)],
            out / "conversations.jsonl",
            out / "quarantine.jsonl",
            out / "counts.json",
            images=calls.image_options(root or None, **data_keys),
        )
        check_invariant(counts)
        t = counts["totals"]
        assert t["rows_in"] == len(records) == t["kept"] + t["duplicates"] + t["quarantined_total"]
        read = [
            [json.loads(x) for x in (out / n).read_text().splitlines()]
            for n in ("conversations.jsonl", "quarantine.jsonl")
        ]
        return counts, *read

    return _run


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------- input shapes


def test_openai_data_uri_part_is_kept_with_its_hash_and_size(run):
    data = png()
    counts, kept, quar = run([oai("What is ", (data_uri(data),), "this?")])
    assert not quar and counts["totals"]["images"] == 1
    content = kept[0]["messages"][0]["content"]
    assert [p["type"] for p in content] == ["text", "image", "text"]
    image = content[1]
    assert image == {"type": "image", "image": data_uri(data), "sha256": sha(data), "width": 16, "height": 12}
    assert kept[0]["messages"][1] == {"role": "assistant", "content": "A red box."}  # text stays a string


def test_paths_and_file_urls_resolve_against_image_root(run, imgdir):
    red = (imgdir / "red.png").read_bytes()
    records = [
        oai(("red.png",), "q1"),
        oai((f"file://{imgdir / 'blue.png'}",), "q2"),  # absolute file:// URL
        oai(("file:sub/green.jpg",), "q3"),  # relative file: URL, under the root too
        oai((str(imgdir / "pic.webp"),), "q4"),  # absolute path
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "red.png"}]},
                {"role": "assistant", "content": "x"},
            ]
        },
    ]
    counts, kept, quar = run(records, root=imgdir)
    assert not quar, quar
    images = [m["content"][0] for c in kept for m in c["messages"] if isinstance(m["content"], list)]
    assert [i["image"] for i in images] == [
        str(imgdir / "red.png"), str(imgdir / "blue.png"), str(imgdir / "sub/green.jpg"),
        str(imgdir / "pic.webp"), str(imgdir / "red.png"),
    ]  # fmt: skip
    assert images[0]["sha256"] == sha(red) and counts["totals"]["images"] == 5


def test_llava_markers_place_images_in_order(run, imgdir):
    record = llava("<image>first <image> second", ["red.png", "blue.png"])
    _, kept, quar = run([record, llava("<image>\nWhat?", "red.png", key="image")], root=imgdir)
    assert not quar
    parts = kept[0]["messages"][0]["content"]
    assert [(p["type"], p.get("text"), p.get("sha256")) for p in parts] == [
        ("image", None, sha((imgdir / "red.png").read_bytes())),
        ("text", "first ", None),
        ("image", None, sha((imgdir / "blue.png").read_bytes())),
        ("text", " second", None),
    ]
    assert kept[1]["messages"][0]["content"][1] == {"type": "text", "text": "\nWhat?"}  # text kept verbatim


def test_hf_image_feature_bytes_become_a_data_uri():
    data = png()
    messages = normalize(
        llava(images=[{"bytes": data, "path": "x.png"}]),
        images=calls.image_options(),
        allow_no_user_turn=False,
    )
    assert messages[0]["content"][0]["image"] == data_uri(data) and messages[0]["content"][0]["sha256"] == sha(data)


# ------------------------------------------------------------------------------------------------ identity


def test_conversations_differing_only_in_their_image_are_both_kept(run, imgdir):
    counts, kept, _ = run([oai(("red.png",), "What is it?"), oai(("blue.png",), "What is it?")], root=imgdir)
    assert counts["totals"]["kept"] == 2 and counts["totals"]["duplicates"] == 0
    assert kept[0]["id"] != kept[1]["id"]


def test_the_same_image_by_path_or_data_uri_is_one_conversation(run, imgdir):
    red = (imgdir / "red.png").read_bytes()
    counts, kept, _ = run([oai(("red.png",), "What?"), oai((data_uri(red),), "What?")], root=imgdir)
    assert counts["totals"]["kept"] == 1 and counts["totals"]["duplicates"] == 1
    # the id hashes the image's bytes, not where it was read from
    assert kept[0]["id"] == conversation_id([{**m, "content": [
        {**p, "image": "anywhere"} if p["type"] == "image" else p for p in m["content"]]}
        if isinstance(m["content"], list) else m for m in kept[0]["messages"]])  # fmt: skip


def test_text_only_demo_gives_the_bytes_it_gave_before_images(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    counts = calls.prepare(
        DEMO,
        out / "conversations.jsonl",
        out / "quarantine.jsonl",
        out / "counts.json",
        images=calls.image_options(),
    )
    assert "images" not in counts["totals"] and set(counts["totals"]["quarantined"]) == set(REASONS)
    assert {n: sha((out / n).read_bytes()) for n in DEMO_SHA256} == DEMO_SHA256


# ---------------------------------------------------------------------------------------------- quarantine


def truncated_png() -> bytes:
    data = png(size=(64, 64))
    return data[: len(data) // 2]


BAD = {
    "image_missing": [oai(("nope.png",)), oai(("file:///no/such/dir/x.png",)), llava(images=["sub/none.jpg"])],
    "image_unreadable": [
        oai((data_uri(truncated_png()),)),
        oai(("trunc.png",)),
        oai((data_uri(b"not an image at all"),)),
        oai(("data:image/png;base64,@@@notbase64",)),
    ],
    "image_unsupported_format": [
        oai((data_uri(png(fmt="TIFF"), "image/tiff"),)),
        oai((data_uri(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"),)),
        oai(("data:text/plain;base64,aGVsbG8=",)),
        oai(("anim.gif",)),
    ],
    "image_remote_url": [oai(("https://example.com/cat.png",)), oai(("file://otherhost/x.png",))],
    "image_count_mismatch": [
        llava("<image> and <image>", ["red.png"]),
        llava("no marker", ["red.png"]),
        llava(images=[]),
    ],
    "image_too_large": [oai(("big.png",))],
    "non_text_content": [
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "red.png"}}]},
            ]
        },
        llava("q", ["red.png"], answer="<image>"),
        oai(("red.png",))
        | {
            "messages": [
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
                {"role": "assistant", "content": "a"},
            ]
        },
    ],
}


@pytest.fixture
def bad_images(imgdir):
    (imgdir / "trunc.png").write_bytes(truncated_png())
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(imgdir / "anim.gif", save_all=True, append_images=frames[1:])
    (imgdir / "big.png").write_bytes(png(size=(200, 100)))
    return imgdir


@pytest.mark.parametrize("reason", list(BAD))
def test_each_bad_image_is_quarantined_with_its_reason(run, bad_images, reason):
    good = oai(("red.png",), "fine")
    counts, kept, quar = run([good, *BAD[reason]], root=bad_images, max_image_pixels=10_000)
    assert len(kept) == 1 and [q["reason"] for q in quar] == [reason] * len(BAD[reason])
    assert counts["totals"]["quarantined"][reason] == len(BAD[reason])
    for q in quar:
        assert "\n" not in q["detail"] and "Traceback" not in q["detail"] and q["detail"]
    if reason == "image_remote_url":
        assert "no network" in quar[0]["detail"]
    if reason == "image_too_large":
        assert "200x100 = 20000 pixels, over data.max_image_pixels = 10000" in quar[0]["detail"]
    if reason == "image_count_mismatch":
        assert quar[0]["detail"] == "2 <image> markers in the text, 1 image in 'images'"
    if reason == "image_missing":
        assert str(bad_images / "nope.png") in quar[0]["detail"]


def test_truncated_png_file_names_its_reason(run, bad_images):
    _, _, quar = run([oai(("trunc.png",))] * 1 + [oai(("red.png",))], root=bad_images)
    assert quar[0]["reason"] == "image_unreadable" and "truncated or corrupt" in quar[0]["detail"]


def test_counts_list_image_reasons_only_in_runs_that_met_an_image(run, imgdir):
    counts, _, _ = run([oai(("red.png",), "q"), oai(("nope.png",), "q")], root=imgdir)
    for c in [*counts["files"], counts["totals"]]:
        assert list(c["quarantined"]) == [*REASONS, *IMAGE_REASONS] and c["images"] == 1
    assert counts["totals"]["quarantined"]["image_missing"] == 1


def test_without_image_options_images_stay_non_text_content(tmp_path, imgdir):
    # the regenerate stage's prompt-only prepare does not read images (yet): as before issue #28
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps(oai(("red.png",))) + "\n" + json.dumps(oai("text only")) + "\n")
    out = tmp_path / "out"
    counts = calls.prepare([str(src)], out / "c.jsonl", out / "q.jsonl", out / "n.json")
    assert counts["totals"]["quarantined"]["non_text_content"] == 1 and counts["totals"]["kept"] == 1


# ------------------------------------------------------------------------------------------ config and rule


def test_image_defaults_match_the_schema():
    from eagle3prep.config import load_schema

    schema = load_schema()["properties"]["data"]["properties"]
    defaults = {k: schema[k]["default"] for k in IMAGE_KEYS}
    assert defaults == {"image_root": None, "max_image_pixels": 4096 * 4096}
    data = DataSettings.defaults(sources=["a.jsonl"])
    assert ImageOptions.of(data).max_pixels == 4096 * 4096  # read from the schema: the code has no default of its own
    data = DataSettings.defaults(sources=["a.jsonl"])  # no params at the defaults: old runs are not re-queued
    assert data.image_params() == {}
    assert DataSettings.defaults(sources=["a.jsonl"], image_root="imgs", max_image_pixels=10).image_params() == {
        "image_root": "imgs",
        "max_image_pixels": 10,
    }


def test_snakemake_script_reads_images_under_image_root(tmp_path, monkeypatch, imgdir):
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps(oai(("red.png",))) + "\n" + json.dumps(oai(("blue.png",))) + "\n")
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # the script redirects it; restored after the test
    smk = SimpleNamespace(
        input=[str(src)],
        output=SimpleNamespace(
            conversations=str(out / "c.jsonl"), quarantine=str(out / "q.jsonl"), counts=str(out / "n.json")
        ),
        params=SimpleNamespace(
            sources=[str(src)], max_line_bytes=1 << 20, image_root=str(imgdir), max_image_pixels=100
        ),
        log=[str(tmp_path / "prepare.log")],
        config=validate_config(
            {"data": {"sources": [str(src)], "max_line_bytes": 1 << 20, "image_root": str(imgdir),
                      "max_image_pixels": 100}, "model": {"path": "model"}}
        ),
    )  # fmt: skip
    # Every row of the file lost: prepare fails after counting them (data.max_quarantine_share).
    with pytest.raises(SystemExit):
        runpy.run_path(str(ROOT / "scripts" / "prepare.py"), init_globals={"snakemake": smk})
    sys.stderr.close()
    log = (tmp_path / "prepare.log").read_text()
    assert "2 rows in, 0 kept, 0 duplicates, 2 quarantined (image_too_large 2)" in log  # 16x12 > 100 pixels
    assert "prepare quarantined 2 of its 2 rows (all; image_too_large 2)" in log.splitlines()[-1]


def test_tokenize_reads_image_parts_and_refuses_malformed_ones_in_one_line():
    image = {"type": "image", "image": "red.png", "sha256": "0" * 64}
    conv = {"id": "x", "source": "a:1", "messages": [
        {"role": "user", "content": [image]}, {"role": "assistant", "content": "a"}]}  # fmt: skip
    assert parse_conversation("c.jsonl", 3, json.dumps(conv)) == conv
    del image["sha256"]  # an image part prepare did not write
    with pytest.raises(TokenizeError, match=r"c\.jsonl:3: not a normalized conversation"):
        parse_conversation("c.jsonl", 3, json.dumps(conv))


def test_image_reasons_are_distinct_from_text_reasons():
    assert not set(IMAGE_REASONS) & set(REASONS)


def test_an_image_root_that_is_not_a_folder_stops_prepare_in_one_line(tmp_path):
    from eagle3prep.prepare import InputError

    with pytest.raises(InputError, match=r"^data\.image_root: '.*nowhere' is not a folder"):
        ImageOptions(str(tmp_path / "nowhere"), max_pixels=4096 * 4096)


def test_an_image_part_in_a_user_message_without_image_options_names_no_role():
    with pytest.raises(Exception, match=r"content part 0 is of type 'image_url', not 'text'$"):
        normalize(oai(("red.png",)), allow_no_user_turn=False)


def test_a_parquet_of_hf_image_features_is_read(tmp_path):
    # datasets' Image feature in parquet: a struct {bytes, path} per image (LLaVA-style sets on the Hub)
    import pyarrow as pa
    import pyarrow.parquet as pq

    red, blue = png(), png((30, 30, 200))
    table = pa.table({
        "conversations": [[{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "A box."}]] * 2,
        "images": [[{"bytes": red, "path": "red.png"}], [{"bytes": blue, "path": "blue.png"}]],
    })  # fmt: skip
    pq.write_table(table, tmp_path / "llava.parquet")
    out = tmp_path / "out"
    counts = calls.prepare(
        [str(tmp_path / "llava.parquet")],
        out / "c.jsonl",
        out / "q.jsonl",
        out / "n.json",
        images=calls.image_options(),
    )
    kept = [json.loads(x) for x in (out / "c.jsonl").read_text().splitlines()]
    assert counts["totals"]["kept"] == 2 and counts["totals"]["images"] == 2
    assert [c["messages"][0]["content"][0]["sha256"] for c in kept] == [sha(red), sha(blue)]
    assert kept[0]["messages"][0]["content"][0]["image"] == data_uri(red)


def test_a_percent_encoded_data_uri_is_read():
    from urllib.parse import quote_from_bytes

    data = png()
    messages = normalize(
        oai((f"data:image/png,{quote_from_bytes(data)}",)),
        images=calls.image_options(),
        allow_no_user_turn=False,
    )
    assert messages[0]["content"][0]["sha256"] == sha(data)
