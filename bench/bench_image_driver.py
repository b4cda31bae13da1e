"""The vllm backend's driver thread on image rows (issue #28 item 7): what a row with images costs the one thread
that submits requests, three ways in the same run, with vLLM's own input processor (its multimodal processor
runs the image processor):

- on the thread: the thread reads, hashes and decodes a row's images (RowImages.images), then vLLM's input
  processor makes its request (the code before 2026-12-02);
- loads ahead: the images are loaded on image_requests.IMAGE_THREADS threads ahead of the loop (the code of 2026-12-02
  loaded them one batch ahead), the input processor still runs on the thread;
- requests ahead: the whole request is made on the threads (paths._WorkerSinkPath._prefetched with
  compat.request_maker, the code now); the thread only takes each request;
- --threads N: the same with N threads, printed with the driver process's CPU time an image (the work that
  competes for its interpreter lock). Until 2026-12-03 a --processes N made the requests in processes forked from
  the driver (docs/runs/bench_image_driver_cpu_2026-12-03_processes.txt); on the H200 they did not speed extract.

    .venv-vllm/bin/python bench/bench_image_driver.py [OUT] [--rows 48] [--images 4] [--repeat 3] [--threads 1 2 4]

The rows are bench_extract.py --images's uniform workload (Pillow-drawn PNGs of 448 pixels a side, 256 vision
tokens each, Qwen2.5-VL's own image processor settings) on the tiny language model: the engine is started on the
CPU only for its input processor, whose cost does not depend on the language model. Printed, per image, the best
of --repeat runs: the input processor alone (images decoded before), and the thread's loop each way. On the H200
plain prefill runs the input processor on one thread too (LLM.generate), so the thread's time per image bounds
the images a second either takes in.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "bench")]


def workload(out: Path, rows: int, images: int) -> tuple[Path, Path]:
    """The model folder (tiny language model, Qwen2.5-VL's image processor) and the uniform tokenized shard, as
    bench_extract.py --tiny --images makes them."""
    from extractbench.workload import make_vl_model_dir, shapes, write_image_workloads

    args = argparse.Namespace(out=out, images=images, image_size=448, text_words=96, rows=rows, max_len=8192)
    shape, vision = shapes(argparse.Namespace(tiny=True, images=images))
    model = make_vl_model_dir(out, shape, vision, args.max_len)
    return model, Path(write_image_workloads(args, model)["uniform"])


def best(fn, repeat: int) -> float:
    return best_cpu(fn, repeat)[0]


def best_cpu(fn, repeat: int) -> tuple[float, float]:
    """(wall s, this process's CPU s, all its threads) of the fastest of `repeat` runs."""
    runs = []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        runs.append((time.perf_counter() - t0, time.process_time() - c0))
    return min(runs)


def engine_of(model: Path, max_len: int):
    """An LLMEngine on the CPU whose input processor is the one extract's engine has (no processor cache). Its
    engine core runs in a process of its own, as extract's does."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the CPU engine warns on every processor call
    from vllm import LLM

    llm = LLM(model=str(model), load_format="dummy", max_model_len=max_len, mm_processor_cache_gb=0, seed=0)
    return llm.llm_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, help="work folder (default: a temporary one)")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--images", type=int, default=4, help="images a row")
    ap.add_argument("--batch-tokens", type=int, default=4096, help="extract.batch_tokens (config.yaml's default)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", help="requests ahead with each of these pool sizes")
    args = ap.parse_args()
    if any(t < 1 for t in args.threads or []):
        ap.error("--threads: each a number of threads, 1 or more")
    import vllm
    from extractbench.phases import use_image_threads
    from vllm import TokensPrompt

    from eagle3prep.backends.vllm import compat
    from eagle3prep.backends.vllm.image_requests import IMAGE_THREADS
    from eagle3prep.backends.vllm.paths import HooksPath, sampling_params
    from eagle3prep.extract import iter_batches
    from eagle3prep.tokenization.row_inputs import ImageRow, RowImages
    from eagle3prep.tokenization.vision import collapse_runs

    with contextlib.ExitStack() as stack:
        out = args.out or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        out.mkdir(parents=True, exist_ok=True)
        model, shard = workload(out, args.rows, args.images)
        engine = engine_of(model, 8192 + 1)
        make = compat.request_maker(engine, vllm.__version__)
        batches = list(iter_batches(shard, args.batch_tokens))
        rows = [r for b in batches for r in b if isinstance(r, ImageRow)]
        n = sum(len(r.row["images"]) for r in rows)
        images = RowImages(model, shard)

        def request(i: int, ids: ImageRow, pils: list):
            collapsed = collapse_runs(list(ids), images.image_token_id)  # as image_requests hands them to vLLM
            prompt = TokensPrompt(prompt_token_ids=collapsed, multi_modal_data={"image": pils})
            return make(f"r{i}", prompt, sampling_params(f"r{i}"))

        decoded = [images.images(r.row) for r in rows]  # warm: page cache, config, processors
        request(0, rows[0], decoded[0])

        def on_thread():
            for i, ids in enumerate(rows):
                request(i, ids, images.images(ids.row))

        def loads_ahead():
            with ThreadPoolExecutor(IMAGE_THREADS) as pool:
                futures = [pool.submit(images.images, ids.row) for ids in rows]  # the pool runs ahead of the loop
                for i, (ids, pils) in enumerate(zip(rows, futures, strict=True)):
                    request(i, ids, pils.result())

        def requests_ahead():
            path = HooksPath([0], "bench", str(model))
            params_of = lambda i: (f"r{i}", sampling_params(f"r{i}"))  # noqa: E731
            with contextlib.closing(path._prefetched(iter(batches), engine, params_of)) as ready:
                for row in ready:
                    if row.ready is not None:
                        row.ready.result()

        proc_s = best(
            lambda: [request(i, ids, d) for i, (ids, d) in enumerate(zip(rows, decoded, strict=True))], args.repeat
        )
        thread_s, loads_s = best(on_thread, args.repeat), best(loads_ahead, args.repeat)
        ahead_s = best(requests_ahead, args.repeat)
        pools = {}  # --threads: whether more threads make requests faster (the GIL, or the cores, bound them)
        for t in args.threads or ():
            use_image_threads(t)
            pools[t] = best_cpu(requests_ahead, args.repeat)
        use_image_threads(IMAGE_THREADS)
    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()}, {os.cpu_count()} CPUs, {platform.python_version()}")
    print(
        f"vLLM {vllm.__version__}; {len(rows)} rows, {n} images of 448 x 448, batch_tokens {args.batch_tokens}, ",
        end="",
    )
    print(f"best of {args.repeat}; {IMAGE_THREADS} threads")
    print(f"input processor alone (images decoded before): {proc_s / n * 1e3:.2f} ms an image")
    print(f"on the thread (load, then the input processor): {thread_s / n * 1e3:.2f} ms an image")
    print(f"loads ahead (the input processor on the thread): {loads_s / n * 1e3:.2f} ms an image")
    print(f"requests ahead (the thread takes each request): {ahead_s / n * 1e3:.2f} ms an image")
    print(
        f"requests ahead / on the thread: {ahead_s / thread_s:.2f}; loads ahead / on the thread: {loads_s / thread_s:.2f}"
    )
    for t, (secs, cpu) in pools.items():
        fewest = pools[min(pools)][0]
        print(
            f"requests ahead, {t} threads: {secs / n * 1e3:.2f} ms an image ({fewest / secs:.2f} x the fewest); "
            f"the driver process's CPU {cpu / n * 1e3:.2f} ms an image"
        )


if __name__ == "__main__":
    main()
