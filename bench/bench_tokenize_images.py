"""Tokenize throughput with images (issue #28 item 7, the CPU part): conversations/s of the tokenize stage on
conversations with images against the same conversations with their images left out, in 1 process and in
--workers worker processes.

    .venv/bin/python bench/bench_tokenize_images.py [--conversations 1500] [--workers 2] [--repeat 3]

The target is the tiny random Qwen2.5-VL (eagle3prep.testing.tiny_vl) with its image processor set to
Qwen2.5-VL's own pixel bounds (3136 to 12845056 pixels, as Qwen's preprocessor_config.json has them), so a
448 x 336 image gets the 192 vision tokens the real model gives it. Images are --distinct JPEG files of
448 x 336 and 336 x 252 pixels (192 and 108 vision tokens), smooth gradients with noise, one or two a
conversation; the text is the demo corpus's words. Both variants are prepared once (untimed); each tokenize
figure is the best of --repeat runs. With images, tokenize reads each image, checks its sha256, decodes it and
runs the image processor, per row, wherever the row is encoded: the CPU seconds of the parent and of its worker
processes say where that work ran. Other jobs may share the cores: the load average is printed at both ends.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = ((448, 336), (336, 252))  # 16 x 12 and 12 x 9 merged patches of 28 pixels: 192 and 108 vision tokens
MAX_SEQ_LEN = 1024  # the tiny target's context; the longest row here is under 900 tokens


def build_target(out: Path) -> Path:
    """The tiny Qwen2.5-VL with Qwen2.5-VL's own image sizes (the tiny one keeps images to 64 tokens for tests)."""
    from eagle3prep.testing.tiny_vl import QWEN25_VL_SIZE, build_tiny_vl

    model = build_tiny_vl(out)
    config = out / "preprocessor_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "size": QWEN25_VL_SIZE}, indent=2))
    return model


def write_images(folder: Path, n: int, seed: int = 0) -> list[str]:
    """`n` JPEG files (names returned): a colour gradient with noise, so decoding costs what a photo's would."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h) + 60 * (i % 3)], axis=-1)
        pixels = np.clip(base + rng.normal(0, 24, (h, w, 3)), 0, 255).astype(np.uint8)
        names.append(f"img_{i:03d}.jpg")
        Image.fromarray(pixels).save(folder / names[-1], quality=90)
    return names


def conversations(n: int, images: list[str], seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(with images, the same without them): one or two images in the first user turn, then 1 to 3 turns."""
    words = (REPO / "resources/demo/tokenizer_corpus.txt").read_text().split()
    rnd = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rnd.choice(words) for _ in range(rnd.randint(lo, hi)))

    with_images, text_only = [], []
    for _ in range(n):
        parts = [{"type": "image_url", "image_url": {"url": rnd.choice(images)}} for _ in range(rnd.randint(1, 2))]
        question = {"type": "text", "text": text(5, 30)}
        turns = [{"role": "assistant", "content": text(10, 60)}]
        for _ in range(rnd.randint(0, 2)):
            turns += [{"role": "user", "content": text(5, 30)}, {"role": "assistant", "content": text(10, 60)}]
        with_images.append({"messages": [{"role": "user", "content": [*parts, question]}, *turns]})
        text_only.append({"messages": [{"role": "user", "content": [question]}, *turns]})
    return with_images, text_only


def prepared(tmp: Path, name: str, records: list[dict], image_root: Path) -> Path:
    """The prepare stage's conversations.jsonl of `records` (what tokenize reads)."""
    from eagle3prep.prepare import prepare
    from eagle3prep.prepare.images import ImageOptions

    src, out = tmp / f"{name}.jsonl", tmp / f"prepared-{name}"
    src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    counts = prepare(
        [str(src)], out / "c.jsonl", out / "q.jsonl", out / "n.json", images=ImageOptions(str(image_root))
    )
    assert counts["totals"]["kept"] == len(records), counts["totals"]
    return out / "c.jsonl"


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its ended child processes (tokenize's workers)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime


def tokenize(model: Path, conversations_path: Path, out: Path, workers: int, repeat: int) -> dict:
    """The tokenize stage, best of `repeat` runs: its stats, wall seconds, and that run's CPU seconds."""
    from eagle3prep.tokenization import tokenize_conversations

    runs = []
    for _ in range(repeat):
        t0, (c0, k0) = time.perf_counter(), cpu_seconds()
        stats = tokenize_conversations(
            conversations_path, model, [out / f"s{k}.jsonl" for k in range(4)], out / "stats.json",
            out / "freq.json", out / "q.jsonl", MAX_SEQ_LEN, workers=workers,
        )  # fmt: skip
        t1, (c1, k1) = time.perf_counter(), cpu_seconds()
        runs.append((t1 - t0, c1 - c0, k1 - k0))
    wall, parent, children = min(runs)
    return {"stats": stats, "wall": wall, "parent_cpu": parent, "workers_cpu": children}


def image_work(model: Path, conversations_path: Path) -> tuple[int, float]:
    """(images, seconds) of reading, hashing, decoding and processing every image of the rows in this process,
    one after another, the calls tokenize makes per row (tokenization.vision): the part images add."""
    from transformers import AutoImageProcessor

    from eagle3prep.tokenization.vision import image_parts, load_image

    processor = AutoImageProcessor.from_pretrained(model)
    rows = [json.loads(x) for x in conversations_path.read_text(encoding="utf-8").splitlines()]
    processor(images=[load_image(image_parts(rows[0]["messages"])[0], 0)])  # first-call set-up, untimed
    t0, n = time.perf_counter(), 0
    for row in rows:
        parts = image_parts(row["messages"])
        processor(images=[load_image(p, k) for k, p in enumerate(parts)])
        n += len(parts)
    return n, time.perf_counter() - t0


def line(label: str, n: int, run: dict) -> str:
    return (
        f"{label:<34}: {n / run['wall']:8.0f} conv/s ({run['wall']:.2f} s; CPU s parent {run['parent_cpu']:.2f}, "
        f"workers {run['workers_cpu']:.2f})"
    )


def report(n: int, runs: dict, workers: int) -> None:
    """Print the figures: per variant and process count, then the ratios."""
    img, txt = runs["images", workers]["stats"], runs["text", workers]["stats"]
    if img["quarantined_total"] or txt["quarantined_total"]:
        raise SystemExit(f"rows were quarantined: {img['quarantined']} / {txt['quarantined']}")
    print(
        f"rows: {img['rows']}; tokens per row: text-only {txt['tokens'] / txt['rows']:.0f}, with images "
        f"{img['tokens'] / img['rows']:.0f} ({img['images']} images, {img['image_tokens'] / img['rows']:.0f} vision "
        f"tokens per row, {img['image_token_share']:.1%} of the tokens)"
    )
    for variant, name in (("text", "text-only"), ("images", "with images")):
        print(line(f"{name}, 1 process", n, runs[variant, 1]))
        print(line(f"{name}, {workers} worker processes", n, runs[variant, workers]))
    for k in (1, workers):
        ratio = runs["images", k]["wall"] / runs["text", k]["wall"]
        print(
            f"with images / text-only, {k} process(es): {1 / ratio:.2f}x the conversations/s ({ratio:.2f}x the time)"
        )
    speedup = runs["images", 1]["wall"] / runs["images", workers]["wall"]
    share = runs["images", workers]["workers_cpu"] / (
        runs["images", workers]["workers_cpu"] + runs["images", workers]["parent_cpu"]
    )
    print(f"with images, {workers} workers / 1 process: {speedup:.2f}x; workers' share of the CPU seconds {share:.1%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=1500)
    ap.add_argument("--distinct", type=int, default=64, help="distinct image files the conversations share")
    ap.add_argument("--workers", type=int, default=2, help="tokenize.workers of the parallel runs")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# bench/bench_tokenize_images.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}, {platform.node()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; load average (1, 5, 15 min) at the start: {load}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="e3p-bench-img-") as tmp_name:
        tmp = Path(tmp_name)
        model = build_target(tmp / "target")
        names = write_images(tmp / "images", args.distinct)
        with_images, text_only = conversations(args.conversations, names)
        sources = {"images": prepared(tmp, "images", with_images, tmp / "images"),
                   "text": prepared(tmp, "text", text_only, tmp / "images")}  # fmt: skip
        print(f"conversations: {args.conversations}; image files: {args.distinct} JPEG, {SIZES[0][0]}x{SIZES[0][1]} "
              f"and {SIZES[1][0]}x{SIZES[1][1]}; best of {args.repeat} runs")  # fmt: skip
        runs = {}
        for variant, path in sources.items():
            for k in (1, args.workers):
                runs[variant, k] = tokenize(model, path, tmp / f"tok-{variant}-{k}", k, args.repeat)
        report(args.conversations, runs, args.workers)
        n_images, seconds = image_work(model, sources["images"])
        share = seconds / runs["images", 1]["wall"]
        print(f"the images alone (read, sha256, decode, image processor), 1 process: {n_images} images in "
              f"{seconds:.2f} s, {seconds / n_images * 1e3:.1f} ms an image, {share:.0%} of tokenize's 1-process time")  # fmt: skip
    print(f"# load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
