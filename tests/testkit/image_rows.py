"""Synthetic conversations with images, made into tokenized shards by the project's own prepare and tokenize
stages (issue #28): for the tests of image capture, the validation matrix's image family and bench_extract's
image workload.

Images are drawn with Pillow from a seed (a background and a few filled shapes), so the same seed gives the
same PNG bytes; sizes that are multiples of 28 pixels keep Qwen2-VL's resize as it is (one vision token per
28 x 28 pixels). Text is words of the demo corpus, drawn from the same seeded generator.
"""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path
from typing import Any

from testkit import calls
from testkit.tiny_models import DEFAULT_CORPUS


def draw_image(width: int, height: int, seed: int) -> bytes:
    """A `width` x `height` PNG: a background and three rectangles or ellipses, all drawn from `seed`."""
    from PIL import Image, ImageDraw

    rnd = random.Random(seed)

    def colour() -> tuple[int, int, int]:
        return (rnd.randrange(256), rnd.randrange(256), rnd.randrange(256))

    img = Image.new("RGB", (width, height), colour())
    draw = ImageDraw.Draw(img)
    for _ in range(3):
        x0, y0 = rnd.randrange(width - 4), rnd.randrange(height - 4)
        box = (x0, y0, rnd.randrange(x0 + 4, width + 1), rnd.randrange(y0 + 4, height + 1))
        getattr(draw, rnd.choice(("rectangle", "ellipse")))(box, fill=colour())
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def chat(images: list[str], question: str, answer: str) -> dict[str, Any]:
    """One user turn (its image parts, then the question) and the assistant's answer, in the OpenAI format;
    no images: a text-only conversation."""
    parts = [{"type": "image_url", "image_url": {"url": image}} for image in images]
    content = [*parts, {"type": "text", "text": question}] if images else question
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}


class Words:
    """Seeded runs of the demo corpus's words."""

    def __init__(self, seed: int, corpus: str | os.PathLike = DEFAULT_CORPUS):
        self.rnd, self.words = random.Random(seed), Path(corpus).read_text(encoding="utf-8").split()

    def __call__(self, n: int) -> str:
        return " ".join(self.rnd.choice(self.words) for _ in range(n))


def tokenize_records(
    records: list[dict[str, Any]], model: str | os.PathLike, root: Path, max_seq_len: int, num_shards: int = 1
) -> list[Path]:
    """`records` through prepare (images read from root/images) and tokenize with `model` into `num_shards`
    contiguous shards root/tok/shard_k.jsonl (stats.json beside them, so data: URIs are found again)."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    src, p, t = root / "in.jsonl", root / "prepared", root / "tok"
    src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    calls.prepare(
        [str(src)],
        p / "c.jsonl",
        p / "q.jsonl",
        p / "n.json",
        images=calls.image_options(root / "images"),
    )
    shards = [t / f"shard_{k}.jsonl" for k in range(num_shards)]
    calls.tokenize(p / "c.jsonl", model, shards, t / "stats.json", t / "tf.json", t / "q.jsonl", max_seq_len)
    return shards


def matrix_records(root: Path, rows: int, shards: int, sizes: list[tuple[int, int]], seed: int = 0) -> list[dict]:
    """`rows` x `shards` conversations for the validation matrix, images written under root/images. In each
    shard's rows: rows 0 and 2 an equal pair (the same words, one image of one size, different pixels: the
    planted rows_swapped and images_swapped have a pair to exchange), every fourth row from row 1 text only,
    the others one or two images of `sizes` (their vision token counts differ), the last image row's first
    image as a data: URI kept in the conversation."""
    import base64

    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    words = Words(seed)
    out = []
    for k in range(shards):
        rnd = random.Random(seed * 1000 + k)
        pair = (words(rnd.randint(4, 12)), words(rnd.randint(4, 20)), rnd.choice(sizes))
        uri_row = max((i for i in range(3, rows) if i % 4 != 1), default=None)
        for i in range(rows):
            if i % 4 == 1:
                out.append(chat([], words(rnd.randint(4, 30)), words(rnd.randint(4, 40))))
                continue
            if i in (0, 2):
                question, answer, shapes = pair[0], pair[1], [pair[2]]
            else:
                question, answer = words(rnd.randint(4, 12)), words(rnd.randint(4, 20))
                shapes = [rnd.choice(sizes) for _ in range(rnd.randint(1, 2))]
            names = []
            for j, (w, h) in enumerate(shapes):
                data = draw_image(w, h, seed=((seed * 1009 + k) * 1009 + i) * 7 + j)
                if i == uri_row and j == 0:
                    names.append("data:image/png;base64," + base64.b64encode(data).decode("ascii"))
                    continue
                names.append(f"s{k}r{i}i{j}.png")
                (images / names[-1]).write_bytes(data)
            out.append(chat(names, question, answer))
    return out
