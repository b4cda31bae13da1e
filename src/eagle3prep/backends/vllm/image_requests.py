"""The requests of rows with images, made ahead of the vllm backend's driver thread (issue #28 item 7).

A row with images costs vLLM's input processor (its multimodal processor runs the image processor) about 10 ms an
image, too much for the driver's one thread at a 7B target's rate. A pool makes the next rows' requests while the
driver's thread adds requests and steps the engine: `IMAGE_THREADS` threads of the driver's process, or with
`IMAGE_PROCESSES` as many worker processes forked from it. On the H200 (docs/performance.md, 2026-12-03) the
threads share the interpreter lock with the driver's thread: 8 threads instead of 4 only moved its wait from the
pool to add_request. Forked processes each have their own lock, and inherit the engine's input processor as it
is, so no vLLM object is rebuilt or pickled; the requests they return come back through shared memory
(multiprocessing's pickler shares a tensor's storage).
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ...tokenization.row_inputs import ImageRow, RowImages
from ...tokenization.vision import collapse_runs

if TYPE_CHECKING:
    from collections.abc import Callable

IMAGE_THREADS = 4  # the pool's workers, threads or processes
AHEAD_ROWS = 4 * IMAGE_THREADS  # rows made ready ahead of the one added (their pixel values held until then)
IMAGE_PROCESSES = False  # make the requests in forked processes instead of threads


def make_request(images: RowImages, ids: ImageRow, make: Callable[[str, Any, Any], Any], tag: str, params: Any):
    """(a row's request, the seconds it took), from its images re-read and checked against their sha256 (a missing
    or changed image raises its row's UserError, passed on as the row is submitted)."""
    from vllm import TokensPrompt

    t0 = time.perf_counter()
    # vLLM's processor expands each image's placeholder itself and does not recognize one tokenize already
    # expanded (it would expand its first token again): it is given one placeholder an image, and the driver
    # verifies, when the request ends, that it gave back the row's ids.
    pils = images.images(ids.row)  # first: it names the row when the target takes no images
    prompt = collapse_runs(list(ids), images.image_token_id)
    # Each image's identifier keys the engine's encoder cache. Without vLLM's processor cache vLLM numbers them
    # per request from a counter of its renderer, which every forked worker holds a copy of: they would give two
    # images one name, and one image's encoder output would be taken for the other's (tests/test_vllm_images.py).
    # The request's tag is unique for the engine's lifetime, so the name is set from it (vLLM's public
    # multi_modal_uuids, which must be unique per item).
    uuids = [f"{tag}-image-{k}" for k in range(len(pils))]
    prompt = TokensPrompt(
        prompt_token_ids=prompt, multi_modal_data={"image": pils}, multi_modal_uuids={"image": uuids}
    )
    request = make(tag, prompt, params)
    return request, time.perf_counter() - t0


class RequestPool:
    """Makes rows' requests on IMAGE_THREADS workers (threads, or forked processes with IMAGE_PROCESSES) with the
    engine's input processor (`make`, compat.request_maker). Each future gives (request, seconds). close() ends the
    workers, their pending work cancelled."""

    def __init__(self, make: Callable[[str, Any, Any], Any], model_path: str):
        self.make, self.model_path = make, model_path
        self._images: RowImages | None = None  # the threads': one tokenized shard's at a time
        self.pool: Executor
        if IMAGE_PROCESSES:
            fork = multiprocessing.get_context("fork")  # the child has the engine's processor without rebuilding it
            self.pool = ProcessPoolExecutor(IMAGE_THREADS, fork, initializer=_child_start, initargs=(make, model_path))
        else:
            self.pool = ThreadPoolExecutor(IMAGE_THREADS, thread_name_prefix="e3p-images")

    def submit(self, ids: ImageRow, tag: str, params: Any) -> Future:
        if isinstance(self.pool, ProcessPoolExecutor):
            return self.pool.submit(_child_request, ids, tag, params)
        if self._images is None or self._images.tokenized != ids.tokenized:
            self._images = RowImages(self.model_path, ids.tokenized)
        return self.pool.submit(make_request, self._images, ids, self.make, tag, params)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


# A forked worker's state: the engine's input processor, the target's folder, the RowImages of the shard it reads.
_child: dict[str, Any] = {}


def _child_start(make: Callable[[str, Any, Any], Any], model_path: str) -> None:
    import torch

    torch.set_num_threads(1)  # one core a worker: the pool, not each image processor call, spreads the work
    _child.update(make=make, model_path=model_path, images=None)


def _child_request(ids: ImageRow, tag: str, params: Any) -> tuple[Any, float]:
    images = _child["images"]
    if images is None or images.tokenized != ids.tokenized:
        images = _child["images"] = RowImages(_child["model_path"], ids.tokenized)
    return make_request(images, ids, _child["make"], tag, params)
