"""The vLLM internals the hooks capture path reads (vllm/capture/hooks/internals.py): each one removed or renamed,
the job stops in one line that names it and the vLLM version; none switches a feature off in silence.

The base-environment tests feed fakes shaped like vLLM 0.32's V1 model runner; the last test (vllm marker)
renames what the hooks read inside a real vllm-cpu engine and sees the probe stop in that one line.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eagle3prep.errors import UserError
from eagle3prep.settings import ExtractSettings
from eagle3prep.shard.sink import Segment
from eagle3prep.vllm import names, registry
from eagle3prep.vllm.capture.hooks import internals
from eagle3prep.vllm.capture.hooks import worker as vllm_ext
from eagle3prep.vllm.capture.hooks.internals import step_layout
from eagle3prep.vllm.capture.hooks.worker import HiddenStatesCapture
from eagle3prep.vllm.capture.requests import TAG_KEY
from eagle3prep.vllm.engine.errors import EngineError, engine_error
from eagle3prep.vllm.registry import INTERNAL_PHRASE

from testkit.shards import capture_spec, with_settings

VERSION = "0.99.0"  # a vLLM release that renamed something


@pytest.fixture(autouse=True)
def later_vllm(monkeypatch):
    internals.vllm_version.cache_clear()
    monkeypatch.setattr(registry, "installed_version", lambda: VERSION)
    yield
    internals.vllm_version.cache_clear()


class Buffer:  # CpuGpuBuffer: .np and .cpu host views
    def __init__(self, values):
        self.cpu = torch.tensor(values, dtype=torch.int32)
        self.np = self.cpu.numpy()


def runner():
    """vLLM 0.32's V1 runner mid-forward: request "r1" (tag t-0) continues at position 4, "r2" (t-1) starts."""
    batch = SimpleNamespace(req_ids=["r1", "r2"], num_reqs=2, num_computed_tokens_cpu=np.array([4, 0]))
    requests = {
        r: SimpleNamespace(sampling_params=SimpleNamespace(extra_args={TAG_KEY: f"t-{i}"}))
        for i, r in enumerate(["r1", "r2"])
    }
    return SimpleNamespace(input_batch=batch, requests=requests, query_start_loc=Buffer([0, 3, 8, 8]))


def without(obj, name):
    """A copy of a SimpleNamespace with attribute `name` gone (a release that renamed it)."""
    ns = SimpleNamespace(**vars(obj))
    delattr(ns, name)
    return ns


def assert_one_line(err: BaseException, internal: str) -> None:
    line = str(err)
    assert isinstance(err, UserError) and "\n" not in line, line
    assert line.startswith(f"vLLM {VERSION} has no {internals.HOOKS_INTERNALS[internal]}"), line
    assert INTERNAL_PHRASE in line and "capture_path: builtin" in line, line


def test_the_fake_runner_reads_as_vllm_0_32():
    assert step_layout(runner()) == [Segment("t-0", 4, 0, 3), Segment("t-1", 0, 3, 8)]


def removed_from_runner():
    """(internal, runner with it removed); before issue #26 item 4, the first two switched the tags off in
    silence (rows then attributed by vLLM's own ids), the rest raised a bare AttributeError traceback."""
    r = runner()
    yield "sampling_params", SimpleNamespace(**{**vars(r), "requests": {k: SimpleNamespace() for k in r.requests}})
    state = SimpleNamespace(sampling_params=SimpleNamespace())  # SamplingParams without extra_args
    yield "extra_args", SimpleNamespace(**{**vars(r), "requests": dict.fromkeys(r.requests, state)})
    yield "requests", without(r, "requests")
    yield "requests", SimpleNamespace(**{**vars(r), "requests": {}})  # not keyed by the scheduled ids
    for name in internals.INPUT_BATCH_FIELDS:
        yield name, SimpleNamespace(**{**vars(r), "input_batch": without(r.input_batch, name)})
    yield "input_batch", SimpleNamespace(**{**vars(r), "input_batch": None})  # the V2 model runner
    yield "query_start_loc", without(r, "query_start_loc")


@pytest.mark.parametrize("internal, fake", list(removed_from_runner()), ids=lambda v: v if isinstance(v, str) else "")
def test_a_missing_runner_internal_stops_the_step_in_one_line(internal, fake):
    with pytest.raises(internals.VLLMInternalError) as err:
        step_layout(fake)
    assert_one_line(err.value, internal)


def test_a_request_sent_without_a_tag_keeps_vllms_id_for_the_sink_to_name():
    """extra_args present but without our tag is a value, not a missing internal: the sink then refuses the row."""
    r = runner()
    r.requests["r2"].sampling_params.extra_args = None
    assert [s.tag for s in step_layout(r)] == ["t-0", "r2"]


class Layer(torch.nn.Module):
    def forward(self, positions, hidden_states, residual):
        return hidden_states, residual


class SwappedLayer(torch.nn.Module):  # a release that reorders the arguments: args[1] would be the residual
    def forward(self, hidden_states, residual, positions):
        return hidden_states, residual


def model(layer=Layer, n=2, **attrs):
    m = torch.nn.Module()
    m.model = torch.nn.Module()
    m.model.layers = torch.nn.ModuleList([layer() for _ in range(n)])
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def worker_with(model_runner) -> HiddenStatesCapture:
    w = HiddenStatesCapture()
    if model_runner is not None:
        w.model_runner = model_runner
    return w


def removed_from_worker():
    yield "model_runner", None, [2]
    yield "model", SimpleNamespace(), [2]
    bare = torch.nn.Module()  # a model whose decoder layers are elsewhere
    yield "layers", SimpleNamespace(model=bare), [2]
    yield "layer_forward", SimpleNamespace(model=model(SwappedLayer)), [0, 2]  # id 0 reads the layer's input


@pytest.mark.parametrize(
    "internal, model_runner, ids", list(removed_from_worker()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_missing_model_internal_stops_the_hook_install_in_one_line(internal, model_runner, ids, monkeypatch):
    monkeypatch.setattr(vllm_ext, "tp_rank", lambda: 0)
    with pytest.raises(internals.VLLMInternalError) as err:
        worker_with(model_runner).e3p_install_hooks(ids)
    assert_one_line(err.value, internal)


def test_a_layer_with_vllms_argument_order_is_hooked(monkeypatch):
    monkeypatch.setattr(vllm_ext, "tp_rank", lambda: 0)
    assert worker_with(SimpleNamespace(model=model())).e3p_install_hooks([0, 2])["hooks"] == 3
    # Without id 0 nothing reads a layer's input, so the argument order is no concern.
    assert worker_with(SimpleNamespace(model=model(SwappedLayer))).e3p_install_hooks([1, 2])["hooks"] == 3


# ---- the one line reaches the user, and auto does not fall back behind their back ------------------------


def the_line() -> str:
    return str(internals.missing("num_computed_tokens_cpu", SimpleNamespace()))


WRAPPED = {
    # in-process engine: our own error comes up through engine.step()
    "in-process": lambda line: (internals.VLLMInternalError(line), ""),
    # multiprocess executor: quoted in vLLM's wrapper
    "worker-rpc": lambda line: (RuntimeError(f"Worker failed with error '{line}', please check the stack trace"), ""),
    # engine core died: the line is in the worker's traceback; the driver sees only vLLM's wrapper
    "engine-core-traceback": lambda line: (
        RuntimeError("EngineCore encountered an issue. See stack trace (above) for the root cause."),
        "(EngineCore pid=1) ERROR 12-02 03:30:00 [core.py:1] Traceback (most recent call last):\n"
        "(EngineCore pid=1)   File x.py, line 1\n"
        f"(EngineCore pid=1) eagle3prep.vllm.registry.VLLMInternalError: {line}\n",
    ),
}


@pytest.mark.parametrize("how", list(WRAPPED))
def test_engine_error_keeps_the_one_line_and_stops_the_fallback(how):
    line = the_line()
    exc, output = WRAPPED[how](line)
    err = engine_error(exc, output, version=VERSION, arch="LlamaForCausalLM", path="hooks")
    assert str(err) == line
    assert getattr(err, "any_path", False), "auto would try the built-in path instead of stopping"
    assert isinstance(err, EngineError | internals.VLLMInternalError)


# ---- the real engine --------------------------------------------------------------------------------------


def vllm_backend(tmp_path, monkeypatch, layer_ids):
    """A VLLMBackend on the demo Llama (N = 8), hooks first, its engine in this process so that a rename made
    here reaches the worker."""
    pytest.importorskip("vllm")
    import os

    from eagle3prep.demo import build_demo_model
    from eagle3prep.vllm.capture.backend import VLLMBackend

    monkeypatch.undo()  # the real version, read from the installed wheel
    internals.vllm_version.cache_clear()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = str(build_demo_model(tmp_path / "model", os.path.join(repo, "resources/demo/tokenizer_corpus.txt")))
    spec = capture_spec(
        backend="vllm", model_path=path, layer_ids=layer_ids, dtype="float32", max_seq_len=64, device="cpu", tp_size=1
    )
    return VLLMBackend(with_settings(spec, ExtractSettings.defaults(capture_path="auto", enforce_eager=True)))


def rename_num_computed_tokens(monkeypatch) -> str:
    """What the hooks read renamed, as a later vLLM release could rename InputBatch.num_computed_tokens_cpu."""
    renamed = tuple(n + "_v2" if n == "num_computed_tokens_cpu" else n for n in internals.INPUT_BATCH_FIELDS)
    monkeypatch.setattr(internals, "INPUT_BATCH_FIELDS", renamed)
    path = "InputBatch." + renamed[-1]  # the registry's entry, renamed with it
    monkeypatch.setitem(internals.HOOKS_INTERNALS, renamed[-1], path)
    entry = dataclasses.replace(registry.entry("InputBatch.num_computed_tokens_cpu"), path=path)
    monkeypatch.setitem(names.BY_PATH, path, entry)
    return path


@pytest.mark.vllm
def test_vllm_cpu_has_every_internal_and_a_renamed_one_stops_the_capture_in_one_line(tmp_path, monkeypatch):
    """Pinned: the installed vLLM has every internal the hooks read (the probe's smoke capture, id 0 included,
    passes); then, with one renamed, the next shard stops in the one line."""
    from testkit.shards import capture_rows

    backend = vllm_backend(tmp_path, monkeypatch, [0, 2, 8])
    try:
        assert backend.probe().capture_path == "hooks"
        internal = rename_num_computed_tokens(monkeypatch)
        with pytest.raises(UserError) as err:
            capture_rows(backend, [[5, 6, 7, 8]])
    finally:
        backend.close()
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"vLLM {registry.installed_version()} has no {internal}"), line
    assert INTERNAL_PHRASE in line, line


@pytest.mark.vllm
def test_vllm_cpu_without_the_internal_stops_the_probe_in_one_line(tmp_path, monkeypatch):
    """auto would try the built-in path next for these ids: the probe stops in the one line instead."""
    backend = vllm_backend(tmp_path, monkeypatch, [2, 5, 8])
    internal = rename_num_computed_tokens(monkeypatch)
    with pytest.raises(UserError) as err:
        backend.probe()
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"vLLM {registry.installed_version()} has no {internal}"), line
    assert INTERNAL_PHRASE in line, line
    print(line)
