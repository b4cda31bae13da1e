import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3prep.records import IndexEntry
from eagle3prep.shard import (
    INDEX,
    TOKEN_IDS,
    ShardWriter,
    StreamingSafetensorsWriter,
    read_index,
    read_manifest,
)


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


def test_shard_writer_layout_and_manifest_last(tmp_path):
    index = [IndexEntry(row=10, id="a", offset=0, length=3), IndexEntry(row=11, id="b", offset=3, length=2)]
    w = ShardWriter(tmp_path / "shard_0", [2, 8], hidden_size=4, dtype="float32", index=index)
    seen = []
    w.append(torch.arange(3), {2: torch.ones(3, 4), 8: torch.zeros(3, 4)})
    w.append(torch.arange(2), {2: torch.ones(2, 4), 8: torch.zeros(2, 4)})
    m = w.finish(
        {"shard": 0}, before_manifest=lambda: seen.append(sorted(p.name for p in (tmp_path / "shard_0").iterdir()))
    )
    # Everything but the manifest was in place before the manifest was written.
    assert seen == [sorted(["layer_2.safetensors", "layer_8.safetensors", TOKEN_IDS, INDEX])]
    assert read_manifest(tmp_path / "shard_0") == m
    assert m["tokens"] == 5 and m["rows"] == 2 and set(m["files"]) == {*seen[0]}
    assert read_index(tmp_path / "shard_0") == index


def test_unfinished_shard_is_not_finished(tmp_path):
    (tmp_path / "layer_2.safetensors").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="not finished"):
        read_manifest(tmp_path)


def test_backend_layer_mismatch_is_refused(tmp_path):
    w = ShardWriter(tmp_path, [2, 8], 4, "float32", [IndexEntry(0, "a", 0, 1)])
    with pytest.raises(ValueError, match="expected \\[2, 8\\]"):
        w.append(torch.arange(1), {2: torch.ones(1, 4), 7: torch.ones(1, 4)})
