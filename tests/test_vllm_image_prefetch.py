"""The vllm backend's driver makes the requests of rows with images on a few threads, ahead of the submission loop
(vllm/capture/feed.prefetched): each such row's images are loaded and vLLM's input processor makes its request
there; every row comes out in order, a bad image stops the capture with the same one-line UserError as a serial load,
a text-only shard starts no thread, and no thread outlives the shard. Base environment: a stand-in engine records
what the driver hands vLLM (its input processor returns what it was given, and the thread it ran on)."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import itertools
import json
import shutil
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from eagle3prep.errors import UserError
from eagle3prep.extract import iter_batches
from eagle3prep.shard.formats import storage_format
from eagle3prep.tokenize.row_inputs import ImageRow, RowImages
from eagle3prep.tokenize.vision import collapse_runs
from eagle3prep.vllm.capture import feed, requests
from eagle3prep.vllm.capture import images as image_requests
from eagle3prep.vllm.capture.hooks.path import HooksPath

from testkit.image_rows import chat, draw_image, tokenize_records

BATCH_TOKENS = 64  # a row or two a batch: several batches to load ahead
POOL = "e3p-images"


@pytest.fixture(scope="module")
def shard(tiny_vl_dir, tmp_path_factory) -> Path:
    """Text rows between rows of one or two tiny images by path, and one image kept as a data: URI."""
    root = tmp_path_factory.mktemp("prefetch")
    (root / "images").mkdir()
    for i, (w, h) in enumerate([(28, 28), (56, 28), (28, 56), (28, 28), (56, 56)]):
        (root / "images" / f"i{i}.png").write_bytes(draw_image(w, h, seed=i))
    uri = "data:image/png;base64," + base64.b64encode(draw_image(28, 28, seed=9)).decode("ascii")
    records = [
        chat(["i0.png"], "What shape?", "A square."),
        chat([], "Name a colour.", "Blue."),
        chat(["i1.png", "i2.png"], "Which is wider?", "The first."),
        chat([uri], "What colour?", "Red."),
        chat([], "Count to three.", "One two three."),
        chat([], "Say yes.", "Yes."),
        chat(["i3.png"], "Anything?", "Shapes."),
        chat(["i4.png"], "And here?", "More shapes."),
    ]
    (out,) = tokenize_records(records, tiny_vl_dir, root, 256)
    return out


def rows_of(shard: Path) -> list[dict]:
    return [json.loads(x) for x in shard.read_text(encoding="utf-8").splitlines()]


def pool_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(POOL)]


def same_images(a: list, b: list) -> bool:
    return [(x.mode, x.size, x.tobytes()) for x in a] == [(x.mode, x.size, x.tobytes()) for x in b]


MADE = itertools.count()  # vLLM 0.26's per-process request counter


class Request(dict):
    """What the stand-in makes: what it was given, and where; `mm_features` as an EngineCoreRequest has them."""


class Processor:
    """vLLM's input processor as images.request_maker calls it. Like vLLM 0.26 with both caches off, it names each
    image from its process's request counter, whatever multi_modal_uuids says."""

    def process_inputs(self, tag, prompt, params, supported_tasks):
        assert supported_tasks == ("generate",)
        torch.set_num_threads(1)  # as vLLM's processor may leave it, called on several threads at once
        request = Request(request=tag, prompt=prompt, params=params, thread=threading.current_thread().name)
        n = next(MADE)
        images = prompt["multi_modal_data"]["image"]
        request.mm_features = [
            SimpleNamespace(modality="image", identifier=f"mm-{n}-image-{k}") for k in range(len(images))
        ]
        return request


class SyncMPClient:
    """What LLMEngine.engine_core is when the engine runs in processes of its own (vLLM's default)."""


class Engine:
    """vLLM's LLMEngine as capture_shard drives it: a request ends at the next step with the row's ids."""

    def __init__(self, expanded: dict[str, list[int]] | None = None):
        self.expanded, self.prompts, self.pending, self.aborted = expanded or {}, {}, [], None
        self.input_processor = Processor()
        self.engine_core = SyncMPClient()
        self.threads_seen: set[str] = set()

    def get_supported_tasks(self):
        return ("generate",)

    def add_request(self, tag, prompt, params):
        self.prompts[tag] = prompt
        self.pending.append(tag)
        self.threads_seen.update(pool_threads())

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        done, self.pending = self.pending, []
        return [
            SimpleNamespace(request_id=t, finished=True, prompt_token_ids=ids, prompt_logprobs=logprobs(ids))
            for t, ids in ((t, self.expanded[t]) for t in done)
        ]

    def abort_request(self, tags):
        self.aborted = tags


def logprobs(ids: list[int]) -> list:
    """vLLM's prompt_logprobs of a row: none at position 0, then each prompt token's."""
    return [None] + [{t: SimpleNamespace(logprob=-1.0)} for t in ids[1:]]


def params_of(index: int, ids: list[int]) -> tuple[str, dict, None]:
    return f"t-{index}", {"tag": f"t-{index}"}, None  # no logits-check prefix request


def prefetched(model: Path, batches, engine: Engine | None = None):
    return feed.prefetched(batches, engine or Engine(), params_of, "0.0", str(model))


def test_every_row_comes_in_order_with_its_request_made_of_the_images_row_images_gives(fake_vllm, tiny_vl_dir, shard):
    want = list(iter_batches(shard, BATCH_TOKENS))
    assert len(want) >= 4 and any(isinstance(r, ImageRow) for b in want for r in b)
    with contextlib.closing(prefetched(tiny_vl_dir, iter_batches(shard, BATCH_TOKENS))) as rows:
        got = [(r.ids, r.ready.result()[0] if r.ready else None, r.batch_end, r.tag) for r in rows]
    assert [g[0] for g in got] == [ids for b in want for ids in b]
    assert [g[3] for g in got] == [f"t-{i}" for i in range(len(got))]  # each row's own tag
    assert [g[2] for g in got] == [k == len(b) - 1 for b in want for k in range(len(b))]  # the batch ends
    direct = RowImages(tiny_vl_dir, shard)
    for i, (ids, request, _, _) in enumerate(got):
        if not isinstance(ids, ImageRow):
            assert request is None
            continue
        assert request["request"] == f"t-{i}" and request["params"] == {"tag": f"t-{i}"}
        assert request["thread"].startswith(POOL)
        assert request["prompt"]["prompt_token_ids"] == collapse_runs(list(ids), direct.image_token_id)
        assert same_images(request["prompt"]["multi_modal_data"]["image"], direct.images(ids.row)), ids.row["row"]
    assert not pool_threads()


def test_each_image_is_named_from_its_requests_tag_whatever_vllm_named_it(fake_vllm, tiny_vl_dir, shard):
    """The identifier that keys the engine's encoder cache is set from the request's unique tag: vLLM 0.26 (as
    the stand-in) names images from a request counter instead, even when given multi_modal_uuids, and that
    counter once gave two images one name (forked workers on the H200, 2026-12-03); the pool's threads
    increment it unlocked."""
    with contextlib.closing(prefetched(tiny_vl_dir, iter_batches(shard, BATCH_TOKENS))) as rows:
        made = [r.ready.result()[0] for r in rows if r.ready]
    assert len(made) == 5
    names = [f.identifier for r in made for f in r.mm_features]
    assert names == [f"{r['request']}-image-{k}" for r in made for k in range(len(r.mm_features))]
    assert all(r["prompt"]["multi_modal_uuids"]["image"] == [f.identifier for f in r.mm_features] for r in made)
    assert len(set(names)) == len(names) == 6


def test_a_request_without_image_identifiers_stops_in_one_line():
    """A vLLM whose request has no mm_features with an identifier (the encoder cache's key) stops in one line."""
    request = SimpleNamespace(mm_features=[SimpleNamespace(modality="image")])
    with pytest.raises(image_requests.VLLMInternalError, match=r"^vLLM's request for 1 image\(s\) has 0 image") as e:
        image_requests.name_images(request, ["t-0-image-0"])
    assert "\n" not in str(e.value)
    with pytest.raises(image_requests.VLLMInternalError, match="request for 2 image"):
        image_requests.name_images(SimpleNamespace(), ["a", "b"])


def test_a_stuck_image_worker_stops_the_capture_in_one_line(fake_vllm, tiny_vl_dir, shard, monkeypatch):
    """A worker that never hands back its row's request stops the capture with one line after WAIT_S, instead of
    hanging the GPU job."""
    monkeypatch.setattr(image_requests, "WAIT_S", 0.5)
    engine, release = Engine(), threading.Event()
    serial = engine.input_processor.process_inputs

    def stuck(tag, prompt, params, supported_tasks):
        release.wait(2)  # a thread cannot be stopped: the pool's close waits for its task
        return serial(tag, prompt, params, supported_tasks)

    engine.input_processor.process_inputs = stuck
    try:
        with pytest.raises(
            requests.CaptureError, match=r"^request t-0: no image worker made it in 0 s \(a worker is stuck\)$"
        ):
            capture(tiny_vl_dir, list(iter_batches(shard, BATCH_TOKENS)), engine=engine)
    finally:
        release.set()


@dataclasses.dataclass
class Spec:
    """What capture_shard reads of a SinkSpec."""

    rows: list
    logprob_rows: tuple = ()
    tag_prefix: str = "t"
    step_tokens: int = 0  # no tail of small steps (vllm/capture/loop.TAIL_PARTS): each test sets its own window
    storage: Any = dataclasses.field(default_factory=lambda: storage_format("model_dtype"))  # sent by name

    @property
    def total_tokens(self) -> int:
        return sum(n for _, n in self.rows)

    def tag(self, i: int) -> str:
        return f"{self.tag_prefix}-{i}"


class LLM:
    def __init__(self, engine: Engine):
        self.llm_engine, self.calls = engine, []

    def collective_rpc(self, name, args=()):
        self.calls.append(name)
        return [{"entries": {}, "stats": {}}]


@pytest.fixture
def fake_vllm(monkeypatch):
    """vllm's TokensPrompt and SamplingParams as plain dicts: the base environment has no vLLM."""
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(TokensPrompt=dict, SamplingParams=lambda **kw: kw))


def capture(model: Path, batches: list, window_tokens: int = BATCH_TOKENS, engine: Engine | None = None) -> LLM:
    """capture_shard of `batches` on the stand-in engine (made here unless given); no pool thread after it."""
    rows = [ids for b in batches for ids in b]
    spec = Spec(rows=[(0, len(r)) for r in rows], logprob_rows=(0,))
    engine = engine or Engine()
    engine.expanded.update({spec.tag(i): list(r) for i, r in enumerate(rows)})
    llm, path = LLM(engine), HooksPath([0], "0.0", str(model))
    path.window_tokens = window_tokens
    threads = torch.get_num_threads()
    try:
        path.capture_shard(llm, iter(batches), spec)
        llm.stats = path.stats
    finally:
        assert not pool_threads()  # shut down on every exit
        assert torch.get_num_threads() == threads  # the process's torch thread count put back
    return llm


def test_the_engine_is_handed_the_threads_requests_and_text_rows_as_token_ids(fake_vllm, tiny_vl_dir, shard):
    batches, engine = list(iter_batches(shard, BATCH_TOKENS)), Engine()
    llm = capture(tiny_vl_dir, batches, engine=engine)
    assert llm.calls[-1] == "e3p_finish_shard" and engine.aborted is None
    assert engine.threads_seen  # the requests were made on the pool, alive while requests went in
    # the driver's seconds: waiting for the threads' requests apart from adding them, and the threads' own
    assert {"driver_wait_s", "driver_add_s", "driver_step_s"} <= set(llm.stats)
    assert llm.stats["image_threads_s"] > 0 and llm.stats["driver_wait_s"] >= 0
    direct = RowImages(tiny_vl_dir, shard)
    rows = [ids for b in batches for ids in b]
    for i, ids in enumerate(rows):
        prompt = engine.prompts[f"t-{i}"]
        if isinstance(ids, ImageRow):
            assert prompt["thread"].startswith(POOL) and prompt["request"] == f"t-{i}"
            assert prompt["params"] == requests.sampling_params(f"t-{i}", logprobs=i == 0)  # row 0 asks for logprobs
            assert prompt["prompt"]["prompt_token_ids"] == collapse_runs(list(ids), direct.image_token_id)
            assert same_images(prompt["prompt"]["multi_modal_data"]["image"], direct.images(ids.row))
        else:
            assert prompt == {"prompt_token_ids": list(ids)}


def test_a_vllm_without_the_input_processor_stops_in_one_line(fake_vllm, tiny_vl_dir, shard):
    engine = Engine()
    del engine.input_processor
    with pytest.raises(
        UserError, match=r"^vLLM 0\.0 has no LLMEngine\.input_processor \(on Engine\) .*make gpu-env\)$"
    ):
        capture(tiny_vl_dir, list(iter_batches(shard, BATCH_TOKENS)), engine=engine)


def broken_copy(shard: Path, out: Path, how: str) -> tuple[Path, dict]:
    """The shard and its stats.json copied to `out`, row 6's image gone or replaced by other bytes."""
    out.mkdir()
    shutil.copy(shard.parent / "stats.json", out / "stats.json")
    rows = rows_of(shard)
    image = out / "i3.png"
    if how == "changed":
        image.write_bytes(draw_image(28, 28, seed=77))
    rows[6]["images"][0]["image"] = str(image)
    copy = out / shard.name
    copy.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return copy, rows[6]


@pytest.mark.parametrize("how", ["missing", "changed"])
def test_a_bad_image_stops_the_capture_with_its_rows_user_error(fake_vllm, tiny_vl_dir, shard, tmp_path, how):
    """Made on a pool's thread, the row's one-line UserError, as a serial load raises it."""
    bad, row = broken_copy(shard, tmp_path / "tok", how)
    with pytest.raises(UserError) as serial:
        RowImages(tiny_vl_dir, bad).images(row)
    assert f"shard_0.jsonl: row {row['row']}, field images: image 0: " in str(serial.value)
    batches, engine = list(iter_batches(bad, BATCH_TOKENS)), Engine()
    with pytest.raises(UserError) as e:
        capture(tiny_vl_dir, batches, window_tokens=10**6, engine=engine)
    assert type(e.value) is type(serial.value) and str(e.value) == str(serial.value)  # raised as the row is submitted
    # the rows before it are aborted
    at = [r["row"] for r in rows_of(bad)].index(row["row"])
    assert engine.aborted == [f"t-{i}" for i in range(at)] and len(engine.prompts) == at


def test_an_interrupt_leaves_no_thread(fake_vllm, tiny_vl_dir, shard):
    with (
        pytest.raises(KeyboardInterrupt),
        contextlib.closing(prefetched(tiny_vl_dir, iter_batches(shard, 16))) as rows,
    ):
        for k, _ in enumerate(rows):
            assert pool_threads()
            if k == 1:
                raise KeyboardInterrupt
    assert not pool_threads()


def test_a_text_only_shard_starts_no_thread(fake_vllm, tiny_vl_dir):
    before = {t.ident for t in threading.enumerate()}
    batches = [[[5, 6, 7], [8, 9]], [[10, 11, 12, 13]], [[14]]]
    engine = Engine()
    capture(tiny_vl_dir, batches, window_tokens=4, engine=engine)
    assert len(engine.prompts) == 4 and not engine.threads_seen
    assert {t.ident for t in threading.enumerate()} == before


def test_rows_are_made_ready_at_most_ahead_rows_ahead(fake_vllm, tiny_vl_dir, shard, monkeypatch):
    """The pool works ahead of the row handed out, by AHEAD_ROWS rows at most: their pixels are held until added."""
    monkeypatch.setattr(image_requests, "AHEAD_ROWS", 2)
    rows = [ids for b in iter_batches(shard, BATCH_TOKENS) for ids in b]
    made: list[str] = []
    engine = Engine()
    serial = engine.input_processor.process_inputs

    def process_inputs(tag, prompt, params, supported_tasks):
        made.append(tag)
        return serial(tag, prompt, params, supported_tasks)

    engine.input_processor.process_inputs = process_inputs
    pulled = 0

    def source():
        nonlocal pulled
        for ids in rows:  # a row a batch: pulled counts rows
            pulled += 1
            yield [ids]

    with contextlib.closing(prefetched(tiny_vl_dir, source(), engine)) as out:
        first = next(out)
        assert pulled == 3  # rows 1 and 2 are being made ready while row 0 is handed out, row 3 not yet read
        assert first.ids == rows[0]
        rest = [(r.ids, r.ready and r.ready.result()) for r in out]  # as the driver takes them
    assert [ids for ids, _ in rest] == rows[1:] and pulled == len(rows)
    images = [f"t-{i}" for i, ids in enumerate(rows) if isinstance(ids, ImageRow)]
    assert sorted(made, key=lambda t: int(t[2:])) == images
