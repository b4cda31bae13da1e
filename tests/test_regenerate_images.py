"""The regenerate stage on conversations with images (issue #28 item 3), without vLLM: the tiny Qwen2.5-VL's chat
template renders the prompt, the images are loaded and checked as tokenize loads them, and the fake engine is given
one placeholder an image plus the images; a bad image or a text-only target quarantines the conversation in one
line, and the regenerated conversation keeps its image parts for tokenize."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import pytest

from eagle3prep.records import Quarantined
from eagle3prep.regenerate import REASONS, PromptRenderer, RegenerateSettings, Runner, ShardTally
from eagle3prep.regenerate import thinking as th
from eagle3prep.regenerate.review import _message_text
from eagle3prep.tokenize import ChatEncoder, load_tokenizer
from eagle3prep.tokenize.vision import collapse_runs

from testkit import calls
from testkit.regenerate import FakeEngine, echo
from testkit.tiny_vl import image_bytes


def user(image: str, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]}  # fmt: skip


TEXT_ONLY = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Prepared conversations: two turns on an image file, an image as a data: URI, an image deleted and one
    changed after prepare, and a text-only one."""
    root = tmp_path_factory.mktemp("regen_images")
    images = root / "images"
    images.mkdir()
    for name in ("red_square.png", "green_bars.png"):
        (images / name).write_bytes(image_bytes(name))
    (images / "gone.png").write_bytes(image_bytes("red_square.png"))
    (images / "changing.png").write_bytes(image_bytes("green_bars.png"))
    uri = "data:image/png;base64," + base64.b64encode(image_bytes("blue_circle.png")).decode("ascii")
    records = [
        {"messages": [user("red_square.png", "What shape?"), {"role": "assistant", "content": "A square."},
                      {"role": "user", "content": "And its colour?"}, {"role": "assistant", "content": "Red."}]},
        {"messages": [user(uri, "What colour?"), {"role": "assistant", "content": "Blue."}]},
        {"messages": [user("gone.png", "What is it?"), {"role": "assistant", "content": "A square."}]},
        {"messages": [user("changing.png", "How many bars?"), {"role": "assistant", "content": "Four."}]},
        TEXT_ONLY,
    ]  # fmt: skip
    src, p = root / "in.jsonl", root / "prepared"
    src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    calls.prepare(
        [str(src)],
        p / "c.jsonl",
        p / "q.jsonl",
        p / "n.json",
        images=calls.image_options(images),
    )
    (images / "gone.png").unlink()
    (images / "changing.png").write_bytes(image_bytes("red_square.png"))  # not the bytes prepare hashed
    convs = [json.loads(x) for x in (p / "c.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(convs) == 5
    return convs


def answer(prompt_text: str) -> tuple[str, str]:
    """echo's reply without the image's vision tokens (a reply that writes a placeholder: the last test)."""
    reply, reason = echo(prompt_text)
    return reply.replace("<|vision_start|><|image_pad|><|vision_end|>", ""), reason


def regenerate(model, convs, script=answer, expand=None):
    renderer = PromptRenderer.load(model, trust_remote_code=False, chat_template_kwargs={})
    engine = FakeEngine(renderer, script, expand=expand)
    tally = ShardTally("prompts.jsonl")
    plan = th.ThinkingPlan("auto", "keep", "inline", ("<think>", "</think>"), "test")
    runner = Runner(engine, renderer, RegenerateSettings.defaults(), plan, renderer.stop_token_ids(), 1024, "p", tally)
    results = list(runner.run([(i + 1, c) for i, c in enumerate(convs)]))
    return SimpleNamespace(renderer=renderer, engine=engine, tally=tally, results=results)


def test_image_prompts_reach_the_engine_with_their_images_and_bad_images_are_quarantined(tiny_vl_dir, prepared):
    run = regenerate(tiny_vl_dir, prepared)
    kept, data_uri, gone, changed, text = run.results
    pad = run.renderer.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    # Two replies, each prompt with the image: one placeholder for the engine, and the image itself.
    requests = sorted(rid for rid in run.engine.ids if rid.startswith("r0-0-"))
    assert requests == ["r0-0-0", "r0-0-1"]
    assert [len(run.engine.images[r]) for r in requests] == [1, 1]
    assert run.engine.images[requests[0]][0].size == (56, 56) and run.engine.images[requests[0]][0].mode == "RGB"
    # The engine's ids are the rendered template's; expanded, they are tokenize's row of the regenerated
    # conversation up to its last reply (the same vision tokens tokenize writes).
    last = kept.messages[:-1]
    assert run.engine.ids[requests[1]] == run.renderer.prompt(last)[1]
    assert run.engine.ids[requests[1]].count(pad) == 1
    encoder = ChatEncoder(
        load_tokenizer(tiny_vl_dir, trust_remote_code=False),
        tiny_vl_dir,
        template_fallback=True,
        chat_template_kwargs={},
    )
    ids, mask, record = encoder.encode([kept.messages])[0]
    first_of_last_reply = max(i for i in range(1, len(mask)) if mask[i] and not mask[i - 1])
    assert collapse_runs(ids[:first_of_last_reply], pad) == run.engine.ids[requests[1]]
    assert record["image_grid_thw"] == [[1, 4, 4]] and ids.count(pad) == 4
    assert run.renderer.image_prompt(last)[1] == ids[:first_of_last_reply]
    # Prompt tokens are counted with the vision tokens, as the engine runs them: 4 for the 56 x 56 square (in two
    # prompts), 6 for the 84 x 56 circle, each in the place of one placeholder.
    assert run.tally.replies["prompt_tokens"] == sum(map(len, run.engine.ids.values())) + 3 + 3 + 5

    # The regenerated conversations keep their image parts as prepare wrote them.
    assert kept.messages[0] == prepared[0]["messages"][0] and kept.messages[2] == prepared[0]["messages"][2]
    assert [m["content"].startswith("Target on:") for m in kept.messages if m["role"] == "assistant"] == [True, True]
    assert data_uri.messages[0]["content"][0]["image"].startswith("data:")
    assert [len(run.engine.images[r]) for r in run.engine.images if r.startswith("r0-1-")] == [1]
    assert text.messages[1]["content"].startswith("Target on: Name a colour.") and "r0-4-0" not in run.engine.images

    # A bad image: quarantined with tokenize's reason, in one line; never given to the engine.
    assert isinstance(gone, Quarantined) and gone.reason == "image_missing"
    assert gone.detail.startswith("reply 0: image 0: ") and "gone.png cannot be read" in gone.detail
    assert isinstance(changed, Quarantined) and changed.reason == "image_changed"
    assert "changing.png is not the image prepare read (sha256 differs)" in changed.detail
    assert "\n" not in gone.detail + changed.detail
    assert not any(r.startswith(("r0-2-", "r0-3-")) for r in run.engine.ids)
    q = run.tally.quarantined
    assert list(q)[: len(REASONS)] == list(REASONS) and (q["image_missing"], q["image_changed"]) == (1, 1)
    assert (run.tally.kept, run.tally.rows_in) == (3, 5)

    # The review shows where the image was read from.
    assert _message_text(kept.messages[0], 200) == f"[user] (image) {prepared[0]['messages'][0]['content'][0]['image']}\nWhat shape?"  # fmt: skip


def test_a_text_only_target_quarantines_image_conversations_in_one_line(demo_model_dir, prepared):
    run = regenerate(demo_model_dir, [prepared[0], prepared[4]])
    image, text = run.results
    assert isinstance(image, Quarantined) and image.reason == "images_unsupported_by_target"
    assert image.detail.startswith("reply 0: the target (") and "has no vision tower" in image.detail
    assert "\n" not in image.detail and list(run.engine.ids) == ["r0-1-0"]
    assert text.messages[1]["content"] == "Target on: Name a colour."


def test_a_text_only_shard_counts_no_image_reasons(demo_model_dir, prepared):
    run = regenerate(demo_model_dir, [prepared[4]])
    assert list(run.tally.file_json()["quarantined"]) == list(REASONS)


def test_a_reply_that_writes_an_image_placeholder_quarantines_its_conversation(tiny_vl_dir, prepared):
    """The next prompt would hold more placeholders than images (tokenize would quarantine the row alike)."""
    (result,) = regenerate(tiny_vl_dir, prepared[:1], script=echo).results
    pad = PromptRenderer.load(
        tiny_vl_dir, trust_remote_code=False, chat_template_kwargs={}
    ).tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert isinstance(result, Quarantined) and result.reason == "reply_has_image_token"
    assert result.detail == f"reply 0 wrote the image placeholder (id {pad})"


def test_a_text_prompt_that_writes_a_vision_placeholder_is_quarantined_before_the_engine(tiny_vl_dir, prepared):
    """A text-only conversation whose prompt holds <|video_pad|> itself: no request, the reason tokenize gives it."""
    conv = {**prepared[4], "messages": [{"role": "user", "content": "What is <|video_pad|>?"},
                                        {"role": "assistant", "content": "Blue."}]}  # fmt: skip
    run = regenerate(tiny_vl_dir, [conv, prepared[4]])
    bad, kept = run.results
    assert isinstance(bad, Quarantined) and bad.reason == "media_token_in_text"
    assert bad.detail.startswith("reply 0: the text writes the target's vision placeholder video_token_id = ")
    assert len(run.engine.ids) == 1 and kept.messages[1]["content"] == "Target on: Name a colour."


def expander(pad: int, fewer: int = 0):
    """A processor's expansion of each placeholder: (w/14) x (h/14) patches merged 2 x 2 (Qwen2.5-VL's), `fewer`
    tokens short of it."""

    def expand(ids, images):
        counts = iter((img.width // 14) * (img.height // 14) // 4 - fewer for img in images)
        return [t for i in ids for t in ([pad] * next(counts) if i == pad else [i])]

    return expand


@pytest.mark.parametrize("fewer", [0, 1], ids=["same", "one_fewer"])
def test_a_prompt_whose_images_the_engine_expands_otherwise_is_quarantined(tiny_vl_dir, prepared, fewer):
    """The engine reports the prompt it ran; a reply to other vision tokens than tokenize writes is not kept."""
    pad = PromptRenderer.load(
        tiny_vl_dir, trust_remote_code=False, chat_template_kwargs={}
    ).tokenizer.convert_tokens_to_ids("<|image_pad|>")
    run = regenerate(tiny_vl_dir, prepared[:2], expand=expander(pad, fewer))
    if not fewer:
        assert [isinstance(r, Quarantined) for r in run.results] == [False, False]
        return
    square, circle = run.results
    assert square.reason == circle.reason == "image_expansion_differs"
    assert (
        square.detail
        == "reply 0: vLLM's processor made 22 prompt tokens of tokenize's 23 (its images expanded differently)"
    )
    assert run.tally.quarantined["image_expansion_differs"] == 2
