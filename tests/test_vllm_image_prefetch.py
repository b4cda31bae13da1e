"""The vllm backend's driver loads rows' images on a few threads one batch ahead of the request submission loop
(paths._WorkerSinkPath._prefetched): every row comes out in order with the images RowImages gives, a bad image
stops the capture with the same one-line UserError as a serial load, a text-only shard starts no thread, and no
thread outlives the shard. Base environment: a stand-in engine records what the driver would hand vLLM."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import shutil
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3prep.backends.vllm import paths
from eagle3prep.errors import UserError
from eagle3prep.extract import iter_batches
from eagle3prep.testing.image_rows import chat, draw_image, tokenize_records
from eagle3prep.tokenization.row_inputs import ImageRow, RowImages
from eagle3prep.tokenization.vision import collapse_runs

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


def test_every_row_comes_in_order_with_the_images_row_images_gives(tiny_vl_dir, shard):
    path = paths.HooksPath([0], "0.0", str(tiny_vl_dir))
    want = list(iter_batches(shard, BATCH_TOKENS))
    assert len(want) >= 4 and any(isinstance(r, ImageRow) for b in want for r in b)
    with contextlib.closing(path._prefetched(iter_batches(shard, BATCH_TOKENS))) as loaded:
        got = [[(ids, images.result() if images else None) for ids, images in batch] for batch in loaded]
    assert [[ids for ids, _ in b] for b in got] == want
    direct = RowImages(tiny_vl_dir, shard)
    for ids, images in (pair for b in got for pair in b):
        if isinstance(ids, ImageRow):
            assert images and same_images(images, direct.images(ids.row)), ids.row["row"]
        else:
            assert images is None
    assert not pool_threads()


@dataclasses.dataclass
class Spec:
    """What capture_shard reads of a SinkSpec."""

    rows: list
    logprob_rows: tuple = ()
    tag_prefix: str = "t"

    def tag(self, i: int) -> str:
        return f"{self.tag_prefix}-{i}"


class Engine:
    """vLLM's LLMEngine as capture_shard drives it: a request ends at the next step with the row's ids."""

    def __init__(self, expanded: dict[str, list[int]]):
        self.expanded, self.prompts, self.pending, self.aborted = expanded, {}, [], None
        self.threads_seen: set[str] = set()

    def add_request(self, tag, prompt, params):
        self.prompts[tag] = prompt
        self.pending.append(tag)
        self.threads_seen.update(pool_threads())

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        done, self.pending = self.pending, []
        return [SimpleNamespace(request_id=t, finished=True, prompt_token_ids=self.expanded[t]) for t in done]

    def abort_request(self, tags):
        self.aborted = tags


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
    spec = Spec(rows=[(0, len(r)) for r in rows])
    engine = engine or Engine({})
    engine.expanded.update({spec.tag(i): list(r) for i, r in enumerate(rows)})
    llm, path = LLM(engine), paths.HooksPath([0], "0.0", str(model))
    path.window_tokens = window_tokens
    try:
        path.capture_shard(llm, iter(batches), spec)
    finally:
        assert not pool_threads()  # shut down on every exit
    return llm


def test_the_engine_is_handed_the_loaded_images_and_one_placeholder_an_image(fake_vllm, tiny_vl_dir, shard):
    batches, engine = list(iter_batches(shard, BATCH_TOKENS)), Engine({})
    llm = capture(tiny_vl_dir, batches, engine=engine)
    assert llm.calls[-1] == "e3p_finish_shard" and engine.aborted is None
    assert engine.threads_seen  # the loads ran on the pool, alive while requests went in
    direct = RowImages(tiny_vl_dir, shard)
    rows = [ids for b in batches for ids in b]
    for i, ids in enumerate(rows):
        prompt = engine.prompts[f"t-{i}"]
        if isinstance(ids, ImageRow):
            assert prompt["prompt_token_ids"] == collapse_runs(list(ids), direct.image_token_id)
            assert same_images(prompt["multi_modal_data"]["image"], direct.images(ids.row))
        else:
            assert prompt == {"prompt_token_ids": list(ids)}


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
    bad, row = broken_copy(shard, tmp_path / "tok", how)
    with pytest.raises(UserError) as serial:
        RowImages(tiny_vl_dir, bad).images(row)
    assert f"shard_0.jsonl: row {row['row']}, field images: image 0: " in str(serial.value)
    batches, engine = list(iter_batches(bad, BATCH_TOKENS)), Engine({})
    with pytest.raises(UserError) as e:
        capture(tiny_vl_dir, batches, window_tokens=10**6, engine=engine)
    assert str(e.value) == str(serial.value)  # raised as the bad row is submitted: the rows before it are aborted
    at = [r["row"] for r in rows_of(bad)].index(row["row"])
    assert engine.aborted == [f"t-{i}" for i in range(at)] and len(engine.prompts) == at


def test_an_interrupt_between_batches_leaves_no_thread(tiny_vl_dir, shard):
    path = paths.HooksPath([0], "0.0", str(tiny_vl_dir))
    with pytest.raises(KeyboardInterrupt), contextlib.closing(path._prefetched(iter_batches(shard, 16))) as loaded:
        for k, _ in enumerate(loaded):
            assert pool_threads()
            if k == 1:
                raise KeyboardInterrupt
    assert not pool_threads()


def test_a_text_only_shard_starts_no_thread(fake_vllm, tiny_vl_dir):
    before = {t.ident for t in threading.enumerate()}
    batches = [[[5, 6, 7], [8, 9]], [[10, 11, 12, 13]], [[14]]]
    engine = Engine({})
    capture(tiny_vl_dir, batches, window_tokens=4, engine=engine)
    assert len(engine.prompts) == 4 and not engine.threads_seen
    assert {t.ident for t in threading.enumerate()} == before


def test_the_loads_run_on_the_pool_one_batch_ahead(tiny_vl_dir, shard, monkeypatch):
    where: dict[int, str] = {}
    loaded_ahead = threading.Event()
    serial = RowImages.images
    want = list(iter_batches(shard, BATCH_TOKENS))
    second = {ids.row["row"] for ids in want[1] if isinstance(ids, ImageRow)}
    assert second, "batch 1 must hold a row with images"

    def images(self, row):
        where[row["row"]] = threading.current_thread().name
        if row["row"] in second:
            loaded_ahead.set()
        return serial(self, row)

    monkeypatch.setattr(RowImages, "images", images)
    pulled = 0

    def source():
        nonlocal pulled
        for batch in want:
            pulled += 1
            yield batch

    path = paths.HooksPath([0], "0.0", str(tiny_vl_dir))
    with contextlib.closing(path._prefetched(source())) as loaded:
        first = next(loaded)
        assert pulled == 2  # batch 1 read while batch 0 is handed out, batch 2 not yet
        assert loaded_ahead.wait(30)  # batch 1's images load before batch 1 is asked for
        assert [ids for ids, _ in first] == want[0]
        rest = list(loaded)
    assert len(rest) == len(want) - 1 and pulled == len(want)
    assert where and all(name.startswith(POOL) for name in where.values()), where
