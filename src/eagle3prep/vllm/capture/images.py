"""The requests of rows with images, made ahead of the capture loop's driver thread.

A row with images costs vLLM's input processor (its multimodal processor runs the image processor) about 10 ms an
image, too much for the driver's one thread at a 7B target's rate. A pool of `IMAGE_THREADS` threads makes the
next rows' requests while the driver's thread adds requests and steps the engine. The threads share the
interpreter lock with the driver's thread; neither 8 threads nor 4 processes forked from the driver (each with
its own lock) moved extract's rate or the GPU's idle share (docs/evidence.md), so the pool stays this simple.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ...tokenize.row_inputs import ImageRow, RowImages
from ...tokenize.vision import collapse_runs
from .. import registry
from ..registry import VLLMInternalError

if TYPE_CHECKING:
    from collections.abc import Callable

IMAGE_THREADS = 4  # the pool's threads
AHEAD_ROWS = 4 * IMAGE_THREADS  # rows made ready ahead of the one added (their pixel values held until then)
WAIT_S = 300.0  # a row's request takes well under a second: a worker this late is stuck, not slow


def request_maker(engine: Any, version: str) -> Callable[[str, Any, Any], Any]:
    """(tag, prompt, params) -> the request LLMEngine.add_request takes in place of a prompt: what add_request
    would make itself (vLLM's input processor, its multimodal processor included), made on the pool's threads
    instead of the driver's one thread. LLMEngine.input_processor.process_inputs returns an EngineCoreRequest,
    which add_request takes as is, in vLLM 0.16 through 0.32 (0.26 and 0.32 warn that this is deprecated).
    A vLLM without them stops in one line (vllm/registry.py)."""
    processor = registry.member(engine, "LLMEngine.input_processor", version=version)
    make = registry.member(processor, "InputProcessor.process_inputs", version=version)
    supported = registry.member(engine, "LLMEngine.get_supported_tasks", version=version)()
    return lambda tag, prompt, params: make(tag, prompt, params, supported_tasks=supported)


def make_request(images: RowImages, ids: ImageRow, make: Callable[[str, Any, Any], Any], tag: str, params: Any):
    """(a row's request, the seconds it took), from its images re-read and checked against their sha256 (a missing
    or changed image raises its row's UserError, passed on as the row is submitted)."""
    TokensPrompt = registry.load("TokensPrompt")  # noqa: N806 - a class

    t0 = time.perf_counter()
    # vLLM's processor expands each image's placeholder itself and does not recognize one tokenize already
    # expanded (it would expand its first token again): it is given one placeholder an image, and the driver
    # verifies, when the request ends, that it gave back the row's ids.
    pils = images.images(ids.row)  # first: it names the row when the target takes no images
    prompt = collapse_runs(list(ids), images.image_token_id)
    # Each image's identifier keys the engine's encoder cache: two images given one name, and one image's encoder
    # output would be taken for the other's. Without vLLM's processor cache vLLM numbers them from a counter that
    # the pool's threads increment unlocked. The request's tag is unique for the engine's lifetime, so the name
    # is set from it (vLLM's public multi_modal_uuids, which must be unique per item; name_images for 0.26).
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
    per-request counter's names (processes forked from the driver then named two images alike and the engine
    died). A request without the field stops in one line."""
    features = [f for f in getattr(request, "mm_features", None) or [] if getattr(f, "modality", None) == "image"]
    named = [f for f in features if hasattr(f, "identifier")]
    if len(named) != len(features) or len(features) != len(uuids):
        raise VLLMInternalError(
            f"vLLM's request for {len(uuids)} image(s) has {len(named)} image mm_features with an identifier "
            "(the encoder cache's key, set per image): install the vLLM pinned in envs/vllm.txt"
        )
    for feature, name in zip(features, uuids, strict=True):
        feature.identifier = name


class RequestPool:
    """Makes rows' requests on IMAGE_THREADS threads with the engine's input processor (`make`,
    request_maker). Each future gives (request, seconds). close() waits for the running tasks (a thread
    cannot be stopped) and, with abandon=True after a failure, cancels the pending ones."""

    def __init__(self, make: Callable[[str, Any, Any], Any], model_path: str):
        self.make, self.model_path = make, model_path
        self._images: RowImages | None = None  # one tokenized shard's at a time
        self._threads = ThreadPoolExecutor(IMAGE_THREADS, thread_name_prefix="e3p-images")

    def submit(self, ids: ImageRow, tag: str, params: Any) -> Future:
        if self._images is None or self._images.tokenized != ids.tokenized:
            self._images = RowImages(self.model_path, ids.tokenized)
        return self._threads.submit(make_request, self._images, ids, self.make, tag, params)

    def close(self, abandon: bool = False) -> None:
        self._threads.shutdown(wait=True, cancel_futures=abandon)
