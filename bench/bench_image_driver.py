"""The vllm backend's driver thread on image rows (issue #28 item 7): what a row's images cost the thread that
submits requests, with the images loaded on that thread (the code before 2026-12-02) and loaded ahead on
paths.IMAGE_THREADS threads (paths._WorkerSinkPath._prefetched), in the same run.

    .venv/bin/python bench/bench_image_driver.py [OUT] [--rows 48] [--images 4] [--repeat 3]

The rows are bench_extract.py --images's uniform workload (the Qwen2.5-VL-7B-shaped folder, Pillow-drawn PNGs of
448 pixels a side, 256 vision tokens each). On the H200 the driver thread also runs vLLM's image processor on each
prompt; here the same Qwen2.5-VL image processor (RowImages.processor) runs on the thread in its place, so the
loop is: take the row's images, process them. Printed, per image: RowImages.images alone (read, sha256, decode),
the processor alone, and the loop's time each way; the best of --repeat runs. No vLLM and no GPU are needed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "bench")]


def workload(out: Path, rows: int, images: int) -> tuple[Path, Path]:
    """The model folder and the uniform tokenized shard, as bench_extract.py --images makes them."""
    from extractbench.workload import make_vl_model_dir, shapes, write_image_workloads

    args = argparse.Namespace(out=out, images=images, image_size=448, text_words=96, rows=rows, max_len=8192)
    shape, vision = shapes(argparse.Namespace(tiny=False, images=images))
    model = make_vl_model_dir(out, shape, vision, args.max_len)
    return model, Path(write_image_workloads(args, model)["uniform"])


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, help="work folder (default: a temporary one)")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--images", type=int, default=4, help="images a row")
    ap.add_argument("--batch-tokens", type=int, default=4096, help="extract.batch_tokens (config.yaml's default)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from eagle3prep.backends.vllm.paths import IMAGE_THREADS, HooksPath
    from eagle3prep.extract import iter_batches
    from eagle3prep.tokenization.row_inputs import ImageRow, RowImages

    with contextlib.ExitStack() as stack:
        out = args.out or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        out.mkdir(parents=True, exist_ok=True)
        model, shard = workload(out, args.rows, args.images)
        rows = [r.row for b in iter_batches(shard, args.batch_tokens) for r in b if isinstance(r, ImageRow)]
        n = sum(len(r["images"]) for r in rows)
        images = RowImages(model, shard)
        processor = images.processor
        decoded = [images.images(r) for r in rows]  # warm: page cache, config, processor

        def serial():  # the thread loads each row's images, then processes them
            for r in rows:
                processor(images=images.images(r), return_tensors="pt")

        def ahead():  # the thread processes images the pool loaded
            path = HooksPath([0], "bench", str(model))
            with contextlib.closing(path._prefetched(iter_batches(shard, args.batch_tokens))) as loaded:
                for batch in loaded:
                    for _, future in batch:
                        if future is not None:
                            processor(images=future.result(), return_tensors="pt")

        load_s = best(lambda: [images.images(r) for r in rows], args.repeat)
        proc_s = best(lambda: [processor(images=d, return_tensors="pt") for d in decoded], args.repeat)
        serial_s, ahead_s = best(serial, args.repeat), best(ahead, args.repeat)
    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()}, {os.cpu_count()} CPUs, {platform.python_version()}")
    print(f"{len(rows)} rows, {n} images of 448 x 448, batch_tokens {args.batch_tokens}, best of {args.repeat}")
    print(f"RowImages.images (read, sha256, decode): {load_s / n * 1e3:.2f} ms an image")
    print(f"image processor ({type(processor).__name__}): {proc_s / n * 1e3:.2f} ms an image")
    print(f"driver loop, images loaded on the thread: {serial_s / n * 1e3:.2f} ms an image")
    print(f"driver loop, images loaded ahead on {IMAGE_THREADS} threads: {ahead_s / n * 1e3:.2f} ms an image")
    print(
        f"ahead / on the thread: {ahead_s / serial_s:.2f} (processor alone / on the thread: {proc_s / serial_s:.2f})"
    )


if __name__ == "__main__":
    main()
