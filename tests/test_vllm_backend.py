"""The vllm backend against an independent transformers forward, on the tiny demo Llama, on CPU.

Runs in .venv-vllm only (vllm-cpu). One module-scoped engine per (capture path, dtype): each start
costs ~30 s on 2 cores, so every check below reuses it. The batch mixes rows of different lengths,
a duplicated row and rows longer than the scheduler's token budget, so one forward step holds
several requests and long rows arrive in chunks (chunked prefill): the attribution that
speculators #279 got silently wrong.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (default 4)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from eagle3prep.demo import build_demo_model  # noqa: E402
from eagle3prep.settings import ExtractSettings  # noqa: E402
from eagle3prep.vllm.capture.backend import VLLMBackend  # noqa: E402

from testkit.shards import capture_rows, capture_spec, with_settings  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Two auxiliary layers and N = 8, the pre-norm final state; plus id 0 (the embeddings) on the hooks
# path, and id 1 instead on the built-in path, which refuses id 0 (vllm/capture/choice.builtin_blocker).
LAYER_IDS = {"builtin": [1, 2, 5, 8], "hooks": [0, 2, 5, 8]}
ALL_IDS = sorted(set(LAYER_IDS["builtin"]) | set(LAYER_IDS["hooks"]))
MAX_SEQ_LEN = 256
BATCH_TOKENS = 64  # scheduler budget per step < longest row: forces chunked prefill and mixed steps
ROW_LENGTHS = [40, 200, 7, 130, 256]
ENGINES = [("builtin", "float32"), ("hooks", "float32"), ("builtin", "bfloat16"), ("hooks", "bfloat16")]
FLOOR_FACTOR = 3.0  # bf16: a capture may differ from fp32 by at most 3x transformers' own bf16 error


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "model"
    return str(build_demo_model(out, os.path.join(REPO, "resources/demo/tokenizer_corpus.txt")))


@pytest.fixture(scope="module")
def rows():
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(5, 500, (n,), generator=g).tolist() for n in ROW_LENGTHS]
    return batch + [batch[0]]  # the same prompt twice: its two rows must not be swapped or merged


def hf_reference(model_path: str, rows: list[list[int]], dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """{layer_id: [sum_T, H] fp32}: output_hidden_states[k] for k < N, the final norm's input for N."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    n = model.config.num_hidden_layers
    final = {}
    model.model.norm.register_forward_pre_hook(lambda mod, args: final.__setitem__("x", args[0]))
    out = {i: [] for i in ALL_IDS}
    with torch.inference_mode():
        for row in rows:  # one row at a time: no padding anywhere in the reference
            hs = model(torch.tensor([row]), output_hidden_states=True, use_cache=False).hidden_states
            for i in ALL_IDS:
                out[i].append((final["x"] if i == n else hs[i])[0].float())  # [T, H]
    return {i: torch.cat(v) for i, v in out.items()}


@pytest.fixture(scope="module")
def reference(model_path, rows):
    return {
        "float32": hf_reference(model_path, rows, torch.float32),
        "bfloat16": hf_reference(model_path, rows, torch.bfloat16),
    }


def write_rows(path, rows: list[list[int]]):
    """A tokenized shard (DESIGN.md §3) of `rows`, every token trained on."""
    import json

    lines = [
        {"row": i, "id": str(i), "input_ids": r, "loss_mask": [1] * len(r), "seq_len": len(r)}
        for i, r in enumerate(rows)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _section(settings: ExtractSettings) -> dict:
    """The engine's extract settings as config keys, to vary a few for one shard."""
    return {"capture_path": settings.content.capture_path, "enforce_eager": settings.content.enforce_eager,
            "max_num_batched_tokens": settings.speed.max_num_batched_tokens}  # fmt: skip


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{p}-{d}" for p, d in ENGINES])
def engine(request, model_path, tmp_path_factory):
    path, dtype = request.param
    spec = capture_spec(
        backend="vllm",
        model_path=model_path,
        layer_ids=LAYER_IDS[path],
        dtype=dtype,
        max_seq_len=MAX_SEQ_LEN,
        device="cpu",
        tp_size=1,
    )
    settings = ExtractSettings.defaults(
        capture_path=path,
        max_num_batched_tokens=BATCH_TOKENS,
        enforce_eager=True,  # torch.compile warm-up would add ~35 s per engine on 2 cores
    )
    backend = VLLMBackend(with_settings(spec, settings))
    info = backend.probe()
    yield backend, info
    backend.close()


def errors(captured: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    c = captured.float()
    diff = c - ref
    return {
        "max_abs": float(diff.abs().max()),
        "rel": float(diff.norm() / ref.norm()),
        "min_cos": float(torch.nn.functional.cosine_similarity(c, ref, dim=-1).min()),
    }


def fmt(err: dict[str, float]) -> str:
    return f"max_abs {err['max_abs']:.3g}, rel {err['rel']:.3g}, min_cos {err['min_cos']:.7f}"


def test_probe_describes_the_engine(engine):
    backend, info = engine
    assert info.engine == "vllm"
    # vllm-cpu 0.16 reports "0.16.0+cpu" in one of its version strings and "0.16.0" in the other
    assert info.engine_version.split("+")[0] == vllm.__version__.split("+")[0]
    assert info.capture_path == backend.settings.content.capture_path
    assert info.tp_size == 1
    assert info.final_layer_reachable is True
    assert (info.num_hidden_layers, info.hidden_size) == (8, 128)
    assert info.details["platform"] == "cpu"
    assert info.details["workarounds"] == []  # no known engine bug on Llama (vllm/engine/workarounds.KNOWN_BUGS)


def rows_of(full: dict[int, torch.Tensor], rows: list[list[int]], order: list[int]) -> dict[int, torch.Tensor]:
    """The reference rows `order` of `full` ([sum_T, H] over all `rows`), concatenated."""
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + len(r))
    return {i: torch.cat([t[offsets[k] : offsets[k + 1]] for k in order]) for i, t in full.items()}


def assert_matches(out, info, ref32, ref16):
    """Every layer of a capture against transformers fp32 (and, for bf16, transformers' own bf16 error)."""
    dtype, layer_ids = info.dtype, LAYER_IDS[info.capture_path]
    assert sorted(out) == layer_ids
    for layer_id in layer_ids:
        got, ref = out[layer_id], ref32[layer_id]  # [sum_T, H] model dtype, [sum_T, H] fp32
        assert tuple(got.shape) == tuple(ref.shape) and got.dtype == getattr(torch, dtype), layer_id
        err = errors(got, ref)
        floor = errors(ref16[layer_id], ref)  # transformers bf16 vs fp32: the dtype's noise on these rows
        print(f"{info.capture_path} {dtype} layer {layer_id}: {fmt(err)}   (transformers bf16: {fmt(floor)})")
        if dtype == "float32":  # two fp32 forwards differ only by summation order
            scale = max(1.0, float(ref.abs().max()))  # stream values reach ~20 on this model
            assert err["max_abs"] <= 1e-5 * scale and err["rel"] <= 1e-5 and err["min_cos"] >= 0.99999, err
        else:  # within a small multiple of transformers' own bf16-vs-fp32 error on the same rows
            assert err["rel"] <= max(FLOOR_FACTOR * floor["rel"], 1e-3), (err, floor)
            assert err["min_cos"] >= 1 - FLOOR_FACTOR * (1 - floor["min_cos"]), (err, floor)


def test_capture_matches_transformers(engine, rows, reference):
    backend, info = engine
    assert_matches(capture_rows(backend, rows), info, reference["float32"], reference["bfloat16"])


def test_a_preempted_long_prefill_lands_right_on_the_builtin_path(model_path, rows, reference, capfd):
    """A KV cache of 12 blocks of 32 and 32 tokens a request a step: three long rows grow side by side until
    vLLM preempts one (recomputed later into new blocks). Its rows that went out in parts before stay, the rest
    come with its final save from the new blocks, and every row still matches transformers."""
    order = [4, 1, 3]  # 256, 200 and 130 tokens
    mine = [rows[k] for k in order]
    spec = capture_spec(backend="vllm", model_path=model_path, layer_ids=LAYER_IDS["builtin"], dtype="float32",
                       max_seq_len=MAX_SEQ_LEN, device="cpu", tp_size=1)  # fmt: skip
    tight = {"num_gpu_blocks_override": 12, "block_size": 32, "long_prefill_token_threshold": 32}
    settings = ExtractSettings.defaults(
        capture_path="builtin", max_num_batched_tokens=BATCH_TOKENS, enforce_eager=True, engine_args=tight
    )
    backend = VLLMBackend(with_settings(spec, settings))
    try:
        info = backend.probe()
        out = capture_rows(backend, mine)
        parts = backend.capture_stats.get("part_tokens", 0)
    finally:
        backend.close()
    assert "(preempted?); rows" in capfd.readouterr().err  # the connector's line: that request's parts stopped
    assert 0 < parts < sum(map(len, mine))
    assert_matches(out, info, rows_of(reference["float32"], rows, order), rows_of(reference["bfloat16"], rows, order))


def test_rows_follow_their_request(engine, rows, reference):
    """The same rows in another order and grouping: each row's states still follow it."""
    backend, info = engine
    order = [3, 0, 5, 1]
    mine = [rows[k] for k in order]
    out = capture_rows(backend, mine, batches=[mine[:1], mine[1:]])
    assert_matches(out, info, rows_of(reference["float32"], rows, order), rows_of(reference["bfloat16"], rows, order))


def test_the_worker_writes_the_layer_files(engine, rows):
    """Both paths write from TP rank 0's worker (its sink's timings come back by RPC); the built-in one
    through our connector, with no lock file or per-request file anywhere (no staging folder at all), a long
    row's rows handed out while it is still being prefilled (prefill_parts.py)."""
    from eagle3prep.vllm.capture.builtin.path import CONNECTOR_MODULE

    backend, info = engine
    capture_rows(backend, rows[:2])
    assert {
        "stall_s",
        "write_s",
        "window_tokens",
        "driver_add_s",
        "driver_step_s",
        "drain_s",
        "finish_s",
        "open_s",
    } <= set(backend.capture_stats), backend.capture_stats
    assert "staging_dir" not in info.volatile
    if info.capture_path == "builtin":  # the drain's own split: the connector's steps, the last rows' lag
        assert backend.capture_stats["drain_steps"] >= 0 and backend.capture_stats["drain_lag_s"] >= 0
    if info.capture_path == "builtin":
        kv = backend.llm.llm_engine.vllm_config.kv_transfer_config
        assert (kv.kv_connector, kv.kv_connector_module_path) == ("E3PHiddenStatesConnector", CONNECTOR_MODULE)
        assert kv.kv_connector_extra_config["use_synchronization_lock"] is False
        # the 200-token row is prefilled over 4 steps of 64: what it computed came out before it finished
        assert 0 < backend.capture_stats.get("part_tokens", 0) < 200, backend.capture_stats


def test_extract_shard_matches_transformers(engine, rows, reference, tmp_path):
    """A whole shard through extract_shard: on both paths TP rank 0's worker's LayerSink writes the layer
    files (the built-in path's rows come through our connector from vLLM's hidden-states cache)."""
    import hashlib

    from safetensors.torch import load_file

    from eagle3prep.extract import extract_shard

    backend, info = engine
    tokenized = write_rows(tmp_path / "shard_0.jsonl", rows)
    # batch_tokens 300: several batches, so rows of two batches share the engine's steps on the hooks path
    # the engine's prompt logprobs of rows 0 and 3
    settings = ExtractSettings.defaults(**_section(backend.settings), logprob_rows=2, batch_tokens=300)
    manifest = extract_shard(
        str(tokenized), str(tmp_path / "out"), with_settings(backend.spec, settings), 0, engine=engine
    )
    out = {i: load_file(tmp_path / "out" / f"layer_{i}.safetensors")["hidden_states"] for i in manifest.layer_ids}
    assert_matches(out, info, reference["float32"], reference["bfloat16"])
    for name, entry in manifest.files.items():
        assert hashlib.sha256((tmp_path / "out" / name).read_bytes()).hexdigest() == entry["sha256"], name
    ids = load_file(tmp_path / "out" / "token_ids.safetensors")["token_ids"]
    assert ids.tolist() == [t for r in rows for t in r]
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")) == []  # no temp files
    # The stored logprobs are vLLM's own, and the captured id N reproduces them (validate's logits check).
    from eagle3prep.validate.logits import check_logprobs

    lp = load_file(tmp_path / "out" / "logprobs.safetensors")
    picked, offsets = lp["rows"].tolist(), lp["offsets"].tolist()
    assert picked == [0, len(rows) // 2] and offsets[-1] == sum(len(rows[r]) - 1 for r in picked)
    n = max(manifest.layer_ids)
    starts = [sum(len(r) for r in rows[:i]) for i in range(len(rows))]
    states = [out[n][starts[r] : starts[r] + len(rows[r])] for r in picked]
    stored = [lp["logprobs"][offsets[k] : offsets[k + 1]] for k in range(len(picked))]
    verdicts = check_logprobs(backend.spec.model_path, states, [rows[r] for r in picked], stored, info.dtype)
    assert all(v["ok"] for v in verdicts), verdicts


def test_scaled_storage_encodes_where_the_rows_are(engine, rows, tmp_path):
    """extract.storage fp8_e4m3 and mxfp4 on the same engine: both paths encode in TP rank 0's worker (the
    SinkSpec's storage travels by RPC), where the rows are. Each scaled shard reads back as the model-dtype
    capture within its format's rounding, and its id N still reproduces vLLM's logprobs."""

    from eagle3prep.extract import extract_shard
    from eagle3prep.shard.formats import storage_format
    from eagle3prep.shard.manifest import read_manifest
    from eagle3prep.shard.readers import read_layer
    from eagle3prep.validate.logits import check_logprobs

    backend, info = engine
    if info.dtype != "bfloat16":
        pytest.skip("one dtype is enough: the storage step does not depend on it")
    tokenized = write_rows(tmp_path / "shard_0.jsonl", rows)
    out = {}
    for storage in ("model_dtype", "fp8_e4m3", "mxfp4"):
        settings = ExtractSettings.defaults(
            **_section(backend.settings), logprob_rows=2, storage=storage, batch_tokens=300
        )
        extract_shard(str(tokenized), str(tmp_path / storage), with_settings(backend.spec, settings), 0, engine=engine)
        out[storage] = {i: read_layer(tmp_path / storage / f"layer_{i}.safetensors", dtype=torch.float32)
                        for i in backend.spec.layer_ids}  # fmt: skip
    from safetensors.torch import load_file

    for storage, (stored_dtype, worst) in {"fp8_e4m3": ("float8_e4m3fn", 0.05), "mxfp4": ("uint8", 0.25)}.items():
        fmt = storage_format(storage)
        manifest = read_manifest(tmp_path / storage)
        assert manifest.format == fmt.mark and manifest.files["layer_8.safetensors"]["dtype"] == stored_dtype
        for i, x in out["model_dtype"].items():
            # the model-dtype capture encoded here is what the worker wrote (a NaN would fail it too)
            assert torch.equal(out[storage][i], fmt.roundtrip(x)), (storage, i)
            err = (out[storage][i] - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)
            assert float(err.max()) < worst, (storage, i, float(err.max()))  # rounding, not another row
        lp = load_file(tmp_path / storage / "logprobs.safetensors")
        picked, offsets = lp["rows"].tolist(), lp["offsets"].tolist()
        starts = [sum(len(r) for r in rows[:i]) for i in range(len(rows))]
        states = [out[storage][8][starts[r] : starts[r] + len(rows[r])] for r in picked]
        stored = [lp["logprobs"][offsets[k] : offsets[k + 1]] for k in range(len(picked))]
        verdicts = check_logprobs(backend.spec.model_path, states, [rows[r] for r in picked], stored, info.dtype, fmt)
        assert all(v["ok"] for v in verdicts), (storage, verdicts)


def test_long_logits_check_rows_are_checked_on_their_first_window(engine, rows, reference, tmp_path, monkeypatch):
    """A logits-check row longer than the logprob window: vLLM computes its prompt logprobs on a prefix request of
    that many tokens (vllm/memory.py), whose rows are never written. The layer files still match
    transformers, the check covers the prefix and passes, and a state one token early still fails it."""

    from safetensors.torch import load_file

    from eagle3prep.extract import extract_shard
    from eagle3prep.validate.logits import check_logprobs
    from eagle3prep.vllm.capture import requests

    window = 64
    monkeypatch.setattr(requests, "LOGPROB_WINDOW", window)
    backend, info = engine
    tokenized = write_rows(tmp_path / "shard_0.jsonl", rows)
    settings = ExtractSettings.defaults(**_section(backend.settings), logprob_rows=len(rows), batch_tokens=300)
    manifest = extract_shard(
        str(tokenized), str(tmp_path / "out"), with_settings(backend.spec, settings), 0, engine=engine
    )
    out = {i: load_file(tmp_path / "out" / f"layer_{i}.safetensors")["hidden_states"] for i in manifest.layer_ids}
    assert_matches(out, info, reference["float32"], reference["bfloat16"])  # the prefix requests wrote nothing
    lp = load_file(tmp_path / "out" / "logprobs.safetensors")
    picked, offsets = lp["rows"].tolist(), lp["offsets"].tolist()
    assert picked == list(range(len(rows)))
    assert [offsets[k + 1] - offsets[k] for k in range(len(rows))] == [min(len(r), window) - 1 for r in rows]
    notes = backend.capture_stats["logprob_notes"]
    assert len(notes) == sum(len(r) > window for r in rows) and f"first {window} of 200 tokens" in notes[0]
    n = max(manifest.layer_ids)
    starts = [sum(len(r) for r in rows[:i]) for i in range(len(rows))]
    states = [out[n][starts[r] : starts[r] + len(rows[r])] for r in picked]
    stored = [lp["logprobs"][offsets[k] : offsets[k + 1]] for k in range(len(picked))]
    verdicts = check_logprobs(backend.spec.model_path, states, rows, stored, info.dtype)
    assert all(v["ok"] for v in verdicts), verdicts
    assert [v["covered_tokens"] for v in verdicts] == [min(len(r), window) for r in rows]
    early = [torch.cat([s[1:], s[-1:]]) for s in states]  # token t holds t + 1's state
    long_rows = [k for k, r in enumerate(rows) if len(r) > window]
    shifted = check_logprobs(backend.spec.model_path, early, rows, stored, info.dtype)
    assert not any(shifted[k]["ok"] for k in long_rows), shifted
