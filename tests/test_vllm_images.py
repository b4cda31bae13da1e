"""Rows with images through the vllm backend (issue #28 items 3 and 5) on the tiny Qwen2.5-VL, on vllm-cpu: the
prompts go in as token ids plus the rows' images (multi_modal_data), vLLM's vision encoder runs in the engine,
and every position, image tokens included, is captured in the usual shard format; the workflow's validation
recomputes them with transformers and passes, and a planted image mistake fails it. One engine per capture path
(hooks, and the built-in path through our connector) serves every test of the module: an engine start costs
~35 s on 2 cores.
"""

from __future__ import annotations

import base64
import json
import os
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")
pytest.importorskip("torchvision", reason="vLLM's Qwen2.5-VL imports it (envs/vllm-vision.txt)")

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (default 4)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from eagle3prep.extract import extract_shard  # noqa: E402
from eagle3prep.settings import ExtractSettings  # noqa: E402
from eagle3prep.validate import ValidationError  # noqa: E402
from eagle3prep.vllm.capture.backend import VLLMBackend  # noqa: E402
from eagle3prep.vllm.capture.requests import CaptureError  # noqa: E402

from testkit import calls  # noqa: E402
from testkit.image_rows import chat, tokenize_records  # noqa: E402
from testkit.planted import plant_image  # noqa: E402
from testkit.shards import capture_spec, with_settings  # noqa: E402
from testkit.tiny_vl import build_tiny_vl, image_bytes  # noqa: E402

# The embeddings (vision tokens merged in), a middle id and N (the pre-norm final state); the built-in path cannot
# take id 0 (vLLM aliases it: the driver refuses it), so it starts at id 1, the first layer's output.
LAYERS = {"hooks": [0, 3, 6], "builtin": [1, 3, 6]}
MAX_SEQ_LEN = 128


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """The tiny Qwen2.5-VL and one tokenized shard: an image by path, a text row, an image as a data: URI."""
    root = tmp_path_factory.mktemp("vlvllm")
    model = build_tiny_vl(root / "model")
    (root / "images").mkdir()
    (root / "images" / "red_square.png").write_bytes(image_bytes("red_square.png"))
    uri = "data:image/png;base64," + base64.b64encode(image_bytes("blue_circle.png")).decode("ascii")
    records = [
        chat(["red_square.png"], "What shape?", "A red square."),
        chat([], "Name a colour.", "Blue."),
        chat([uri], "What colour?", "Blue."),
    ]
    (shard,) = tokenize_records(records, model, root, MAX_SEQ_LEN)
    rows = [json.loads(x) for x in shard.read_text(encoding="utf-8").splitlines()]
    return SimpleNamespace(root=root, model=str(model), shard=shard, rows=rows)


@pytest.fixture(scope="module", params=["hooks", "builtin"])
def engine(vl, request):
    path = request.param
    spec = capture_spec(
        backend="vllm", model_path=vl.model, layer_ids=LAYERS[path], dtype="float32", max_seq_len=MAX_SEQ_LEN, device="cpu",
        tp_size=1,
    )  # fmt: skip
    settings = ExtractSettings.defaults(capture_path=path, max_num_batched_tokens=64, enforce_eager=True)
    backend = VLLMBackend(with_settings(spec, settings))
    info = backend.probe()
    yield SimpleNamespace(
        spec=spec, settings=settings, backend=backend, info=info, path=path, hs=vl.root / f"hs_{path}"
    )
    backend.close()


def extract(vl, engine, shard, out):
    return extract_shard(
        str(shard), str(out), with_settings(engine.spec, engine.settings), 0, engine=(engine.backend, engine.info)
    )


def validate(vl, shard_dir):
    return calls.validate(shard_dir, vl.shard, vl.root / "v.json", vl.model)


def test_vllm_captures_image_rows_and_validation_passes_them(vl, engine):
    from eagle3prep.shard.readers import read_index

    assert [bool(r.get("images")) for r in vl.rows] == [True, False, True]
    hs = engine.hs
    manifest = extract(vl, engine, vl.shard, hs)
    assert manifest.engine["capture_path"] == engine.path
    index = read_index(hs)
    assert [e.length for e in index] == [r["seq_len"] for r in vl.rows]  # every position, image tokens included
    report = validate(vl, hs)
    assert report["ok"] and report["reference_sample"]["rows"] == 3, report
    assert {c["check"] for c in report["checks"]} >= {f"reference:layer_{lid}" for lid in engine.spec.layer_ids}


def test_a_planted_image_mistake_in_a_vllm_shard_fails_validation(vl, engine):
    hs = engine.hs
    if not (hs / "manifest.json").exists():
        extract(vl, engine, vl.shard, hs)
    out = plant_image("image_dropped", hs, vl.root / f"dropped_{engine.path}", vl.shard, vl.model)
    with pytest.raises(ValidationError) as e:
        validate(vl, out)
    assert set(e.value.failed) == {f"reference:layer_{lid}" for lid in engine.spec.layer_ids}, e.value
    assert "2 of 3 rows fail" in str(e.value)


def test_a_row_whose_image_tokens_vllm_would_expand_otherwise_stops_in_one_line(vl, engine, tmp_path):
    """Tokenize's row with one image token fewer: vLLM's processor does not keep it as it is (it re-expands or
    refuses), and the capture stops with one line instead of writing rows of other lengths."""
    row = dict(vl.rows[0])
    pad = json.loads((vl.root / "model" / "config.json").read_text(encoding="utf-8"))["image_token_id"]
    first = row["input_ids"].index(pad)
    ids = row["input_ids"][:first] + row["input_ids"][first + 1 :]
    bad = {**row, "input_ids": ids, "loss_mask": row["loss_mask"][:-1], "seq_len": len(ids)}
    (tmp_path / "stats.json").write_text((vl.shard.parent / "stats.json").read_text(encoding="utf-8"))
    shard = tmp_path / "shard_0.jsonl"
    shard.write_text(json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(
        CaptureError, match=r"vLLM's processor made 33 prompt tokens of the row's 32 \(its images"
    ) as e:
        extract(vl, engine, shard, tmp_path / "hs")
    assert "\n" not in str(e.value), e.value


def features(request) -> list[tuple]:
    """What an EngineCoreRequest carries of its images: each one's identifier (the key of vLLM's encoder cache),
    placeholder range and tensors."""
    import torch

    out = []
    for f in request.mm_features or []:
        tensors = {k: getattr(v, "data", v) for k, v in dict(f.data or {}).items()}
        out.append((f.identifier, f.mm_position, {k: torch.as_tensor(t).clone() for k, t in tensors.items()}))
    return out


def test_requests_made_by_the_image_pool_are_the_ones_vllm_makes_on_one_thread(vl, engine, tmp_path):
    """The driver makes rows' requests with vLLM's input processor on image_requests.RequestPool, IMAGE_THREADS
    threads at once. Each must equal the request the same processor makes on the driver's thread, image by image,
    and each image is named from its request's tag. The engine was started without vLLM's processor cache, which
    is not made for that."""
    import torch

    from eagle3prep.tokenize.row_inputs import ImageRow, RowImages
    from eagle3prep.vllm.capture import images as image_requests
    from eagle3prep.vllm.capture import requests

    from testkit.image_rows import draw_image

    llm_engine = engine.backend.llm.llm_engine
    assert llm_engine.vllm_config.model_config.multimodal_config.mm_processor_cache_gb == 0
    (tmp_path / "images").mkdir()
    sizes = [(28, 28), (56, 28), (28, 56), (56, 56)]
    records = []
    for i in range(12):  # rows of one or two images of other sizes: requests of other lengths
        names = [f"r{i}i{j}.png" for j in range(1 + i % 2)]
        for j, name in enumerate(names):
            (tmp_path / "images" / name).write_bytes(draw_image(*sizes[(i + j) % 4], seed=100 + 2 * i + j))
        records.append(chat(names, f"Row {i}?", "Shapes."))
    (shard,) = tokenize_records(records, vl.model, tmp_path, MAX_SEQ_LEN)
    rows = [ImageRow(json.loads(x), shard) for x in shard.read_text(encoding="utf-8").splitlines()]
    make = image_requests.request_maker(llm_engine, vllm.__version__)
    tags = [f"pool-check-{i}" for i in range(len(rows))]
    images = RowImages(vl.model, shard)
    serial = [
        image_requests.make_request(images, r, make, t, requests.sampling_params(t))[0]
        for r, t in zip(rows, tags, strict=True)
    ]
    pool = image_requests.RequestPool(make, str(vl.model))
    try:
        futures = [pool.submit(r, t, requests.sampling_params(t)) for r, t in zip(rows, tags, strict=True)]
        made = [f.result()[0] for f in futures]
    finally:
        pool.close()
    by_tag = {r.request_id: r for r in made}
    assert sorted(by_tag) == sorted(tags)
    # Without the processor cache an image's identifier is made per request, not from its pixels: no two may meet,
    # or the engine would take one image's encoder output for another's. Each is named from its request's tag.
    ids = [f[0] for r in made for f in features(r)]
    assert len(ids) == len(set(ids)) == sum(len(r.row["images"]) for r in rows)
    assert ids == [f"{r.request_id}-image-{k}" for r in made for k in range(len(features(r)))]
    for want in serial:
        got = by_tag[want.request_id]
        assert got.prompt_token_ids == want.prompt_token_ids
        a, b = features(got), features(want)
        assert [x[1] for x in a] == [x[1] for x in b]  # the placeholder ranges
        for (_, _, ta), (_, _, tb) in zip(a, b, strict=True):
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
