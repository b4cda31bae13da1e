import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3prep.records import IndexEntry
from eagle3prep.shard.files import StreamingSafetensorsWriter
from eagle3prep.shard.formats import storage_format
from eagle3prep.shard.layout import INDEX, TOKEN_IDS
from eagle3prep.shard.manifest import read_manifest
from eagle3prep.shard.readers import read_index
from eagle3prep.shard.sink import LayerSink, Segment, SinkPlan
from eagle3prep.shard.writer import ShardWriter

from testkit.shards import manifest_fields


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_streamed_file_is_byte_identical_to_safetensors_save_file(tmp_path, dtype):
    full = torch.randn(37, 16).to(dtype)  # [sum_T, H]
    save_file({"hidden_states": full}, tmp_path / "ref.safetensors")
    w = StreamingSafetensorsWriter(tmp_path / "ours.safetensors", "hidden_states", str(dtype)[6:], (37, 16))
    for a in range(0, 37, 10):
        w.append(full[a : a + 10])
    entry = w.finish()
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert entry["bytes"] == (tmp_path / "ours.safetensors").stat().st_size
    with safe_open(tmp_path / "ours.safetensors", framework="pt") as f:
        assert torch.equal(f.get_slice("hidden_states")[5:9], full[5:9])


def test_short_or_wrong_writes_fail_and_leave_nothing(tmp_path):
    w = StreamingSafetensorsWriter(tmp_path / "x.safetensors", "hidden_states", "float32", (4, 2))
    with pytest.raises(ValueError, match="dtype"):
        w.append(torch.zeros(1, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        w.append(torch.zeros(1, 3))
    w.append(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="3 rows written, 4 declared"):
        w.finish()
    assert not list(tmp_path.iterdir())


def _write(w: ShardWriter, batches: list[list[list[int]]], layers: dict[int, float]) -> dict:
    """Batches through the writer's token tee and a LayerSink: layer `lid` holds `layers[lid]` everywhere."""
    sink = LayerSink(w.sink_spec(SinkPlan(8, 3, "row")))
    first = 0
    for batch in w.tee(iter(batches)):
        n = sum(map(len, batch))
        sink.begin_step(
            [
                Segment(sink.spec.tag(first + i), 0, sum(map(len, batch[:i])), sum(map(len, batch[: i + 1])))
                for i in range(len(batch))
            ]
        )
        first += len(batch)
        for lid, value in layers.items():
            sink.add_layer(lid, torch.full((n, 4), value))
    return sink.finish()


def test_shard_writer_layout_and_manifest_last(tmp_path, monkeypatch):
    from eagle3prep.infra import faults

    index = [IndexEntry(row=10, id="a", offset=0, length=3), IndexEntry(row=11, id="b", offset=3, length=2)]
    model_dtype = storage_format("model_dtype")
    w = ShardWriter(tmp_path / "shard_0", [2, 8], hidden_size=4, dtype="float32", index=index, storage=model_dtype)
    seen = []
    entries = _write(w, [[[1, 2, 3]], [[4, 5]]], {2: 1.0, 8: 0.0})
    # The kill point before the manifest: where a crash leaves every file but the manifest.
    monkeypatch.setattr(
        faults, "kill_point", lambda name, **kw: seen.append((name, sorted(p.name for p in w.out_dir.iterdir())))
    )
    m = w.finish(entries, manifest_fields(), timings={"capture_s": 1.0}, kill_point=("extract.before_manifest", {}))
    # Everything but the manifest was in place before the manifest was written.
    files = sorted(["layer_2.safetensors", "layer_8.safetensors", TOKEN_IDS, INDEX])
    assert [x for x in seen if x[0] == "extract.before_manifest"] == [
        ("extract.before_manifest", sorted([*files, "timings.json"]))
    ]
    assert read_manifest(tmp_path / "shard_0") == m
    assert m.tokens == 5 and m.rows == 2 and set(m.files) == set(files)
    assert read_index(tmp_path / "shard_0") == index
    with safe_open(tmp_path / "shard_0" / TOKEN_IDS, framework="pt") as f:
        assert f.get_tensor("token_ids").tolist() == [1, 2, 3, 4, 5]


def test_unfinished_shard_is_not_finished(tmp_path):
    (tmp_path / "layer_2.safetensors").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="not finished"):
        read_manifest(tmp_path)


def test_backend_layer_mismatch_is_refused(tmp_path):
    w = ShardWriter(tmp_path, [2, 8], 4, "float32", [IndexEntry(0, "a", 0, 1)], storage=storage_format("model_dtype"))
    entries = _write(w, [[[7]]], {2: 1.0, 8: 2.0})
    with pytest.raises(ValueError, match="expected \\[2, 8\\]"):
        w.finish({2: entries[2], 7: entries[8]}, manifest_fields())
