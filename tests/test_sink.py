"""Rows written by position (the one write path of every backend), without vLLM: plain torch.

shard.sink.LayerSink gets forward steps as the hooks see them (a Segment per request chunk, a
[step_tokens, H] tensor per layer) and must produce exactly the file that an in-order
StreamingSafetensorsWriter writes from the same rows: same bytes, same sha256.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import random
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from eagle3prep.infra.disk import DiskSpaceError
from eagle3prep.records import IndexEntry
from eagle3prep.shard import files as shard_files
from eagle3prep.shard.files import BackgroundFlush, PositionalSafetensorsWriter, StreamingSafetensorsWriter
from eagle3prep.shard.formats import FORMAT_FP8, storage_format
from eagle3prep.shard.fp8 import SCALES_KEY
from eagle3prep.shard.layout import layer_file, temp_of
from eagle3prep.shard.manifest import read_manifest
from eagle3prep.shard.readers import read_layer
from eagle3prep.shard.sink import LayerSink, Segment, SinkPlan, SinkSpec
from eagle3prep.shard.writer import ShardWriter

from testkit.shards import manifest_fields
from testkit.writers import write_layer

H = 32  # a whole MXFP4 block
LAYERS = [0, 3, 5]


def write_rows(w: PositionalSafetensorsWriter, first_row: int, data) -> None:
    """One range as the sink's two threads hand it over: placed on disk, then hashed in file order."""
    w.place(first_row, data)
    w.account(first_row, data)


def rows_tensor(total: int, layer_id: int) -> torch.Tensor:
    """Distinct values per (layer, row): a misplaced row cannot go unnoticed."""
    base = torch.arange(total * H, dtype=torch.float32).reshape(total, H)
    return (base + 1000 * layer_id).to(torch.bfloat16)


def streamed(tmp_path, total: int, layer_id: int, meta: dict | None = None) -> tuple[bytes, dict]:
    """The reference: the in-order writer's file and entry for the same rows (`meta`: a layer file's metadata,
    as the sink writes it)."""
    w = StreamingSafetensorsWriter(
        tmp_path / "ref.safetensors", "hidden_states", "bfloat16", (total, H), metadata=meta
    )
    w.append(rows_tensor(total, layer_id))
    entry = w.finish()
    data = (tmp_path / "ref.safetensors").read_bytes()
    (tmp_path / "ref.safetensors").unlink()
    return data, entry


# ---- PositionalSafetensorsWriter ------------------------------------------------------------------
def test_positional_writer_out_of_order_equals_streamed(tmp_path):
    total = 50
    rows = rows_tensor(total, 3)
    w = PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "bfloat16", (total, H))
    ranges = [(0, 7), (7, 20), (20, 21), (21, 50)]
    for a, b in [ranges[2], ranges[0], ranges[3], ranges[1]]:  # two ranges arrive ahead of a gap
        write_rows(w, a, rows[a:b].view(torch.uint8).numpy())
    entry = w.seal()
    temp_of(tmp_path / "a.safetensors").rename(tmp_path / "a.safetensors")
    ref_bytes, ref_entry = streamed(tmp_path, total, 3)
    assert (tmp_path / "a.safetensors").read_bytes() == ref_bytes
    assert entry == ref_entry
    assert entry["sha256"] == hashlib.sha256(ref_bytes).hexdigest()


def test_positional_writer_keeps_no_early_range_in_memory_and_hashes_it_from_the_file(tmp_path):
    """A range ahead of the gap is hashed from the file once the gap fills: the caller reuses its buffer
    at once (the sink's slot goes back to the pool), and the host holds none of its bytes meanwhile."""
    total = 30
    rows = rows_tensor(total, 5).view(torch.uint8).numpy()
    w = PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "bfloat16", (total, H))
    buf = rows[10:30].copy()
    write_rows(w, 10, buf)
    buf[:] = 0  # the slot is reused for the next step
    assert all(isinstance(n, int) for n in w._early.values())  # a row count, not the bytes
    write_rows(w, 0, rows[0:10])
    entry = w.seal()
    _, ref_entry = streamed(tmp_path, total, 5)
    assert entry == ref_entry


def test_a_read_back_reads_into_one_buffer(tmp_path, monkeypatch):
    """An early range longer than the read-back buffer is hashed in several reads, all into the same buffer
    (no new bytes object a read), and the hash still equals the in-order writer's."""
    from eagle3prep.shard import files

    monkeypatch.setattr(files, "READBACK_BYTES", 3 * H * 2 + 5)  # 3 rows and a part: reads end mid-row
    buffers = []
    preadv = os.preadv
    monkeypatch.setattr(files.os, "preadv", lambda fd, bufs, pos: buffers.append(bufs[0].obj) or preadv(fd, bufs, pos))
    monkeypatch.setattr(files.os, "pread", None)  # nothing reads into a new bytes object
    total = 30
    rows = rows_tensor(total, 6).view(torch.uint8).numpy()
    w = PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "bfloat16", (total, H))
    write_rows(w, 10, rows[10:30])
    write_rows(w, 0, rows[0:10])
    entry = w.seal()
    _, ref_entry = streamed(tmp_path, total, 6)
    assert entry == ref_entry
    assert len(buffers) >= 6 and all(b is buffers[0] for b in buffers)  # 20 rows, at most 3.x a read


@pytest.mark.parametrize("second", [(3, 5), (0, 1), (9, 12)], ids=["inside-written", "first-row", "inside-early"])
def test_positional_writer_refuses_a_range_twice(tmp_path, second):
    rows = rows_tensor(20, 0).view(torch.uint8).numpy()
    w = PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "bfloat16", (20, H))
    write_rows(w, 0, rows[0:6])
    write_rows(w, 8, rows[8:14])  # early: rows 6..7 not there yet
    with pytest.raises(ValueError, match="written twice"):
        write_rows(w, second[0], rows[second[0] : second[1]])
    w.abort()


def test_positional_writer_with_a_hole_is_never_sealed(tmp_path):
    rows = rows_tensor(10, 0).view(torch.uint8).numpy()
    w = PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "bfloat16", (10, H))
    write_rows(w, 0, rows[0:4])
    write_rows(w, 6, rows[6:10])
    with pytest.raises(ValueError, match=r"rows 4\.\. never arrived"):
        w.seal()
    assert list(tmp_path.iterdir()) == []  # the temp file is gone


def test_positional_writer_refuses_rows_outside_the_shape_and_partial_rows(tmp_path):
    rows = rows_tensor(10, 0).view(torch.uint8).numpy()
    w = PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "bfloat16", (10, H))
    with pytest.raises(ValueError, match="outside the 10 declared"):
        write_rows(w, 8, rows[0:4])
    with pytest.raises(ValueError, match="not a whole number"):
        write_rows(w, 0, rows[0:2].reshape(-1)[:5])
    w.abort()


def test_a_read_back_waits_until_another_thread_placed_the_range(tmp_path, monkeypatch):
    """The sink's two threads: the hash thread reads an early range back only once the write thread placed it."""
    total = 30
    rows = rows_tensor(total, 5).view(torch.uint8).numpy()
    w = PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "bfloat16", (total, H))
    first_byte = {w._data_start: "rows 0..", w._data_start + 10 * w.row_bytes: "rows 10.."}
    events, waiting = [], threading.Event()
    real_pwrite, real_preadv = shard_files.os.pwrite, shard_files.os.preadv

    def pwrite(fd, data, offset):
        done = real_pwrite(fd, data, offset)
        events.append(f"placed {first_byte[offset]}")
        return done

    def preadv(fd, buffers, offset):
        events.append(f"read back {first_byte[offset]}")
        return real_preadv(fd, buffers, offset)

    class Watched(threading.Condition):
        def wait(self, timeout=None):
            events.append("hash thread waits")
            waiting.set()
            return super().wait(timeout)

    monkeypatch.setattr(shard_files.os, "pwrite", pwrite)
    monkeypatch.setattr(shard_files.os, "preadv", preadv)
    w._placed_cond = Watched()
    hasher = threading.Thread(target=lambda: (w.account(10, rows[10:30]), w.account(0, rows[0:10])), daemon=True)
    w.place(0, rows[0:10])
    hasher.start()  # rows 10.. came early: read back once rows 0.. are hashed, but they are not placed yet
    assert waiting.wait(5), "the read-back did not wait for its rows"
    w.place(10, rows[10:30])
    hasher.join(5)
    assert not hasher.is_alive()
    assert events == ["placed rows 0..", "hash thread waits", "placed rows 10..", "read back rows 10.."]
    entry = w.seal()
    assert entry == streamed(tmp_path, total, 5)[1]


def test_a_cancelled_writer_ends_a_read_back_that_waits_for_rows_never_placed(tmp_path):
    rows = rows_tensor(20, 0).view(torch.uint8).numpy()
    w = PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "bfloat16", (20, H))
    w.place(0, rows[0:10])  # rows 10.. never will be: the write thread failed
    outcome = []
    hasher = threading.Thread(
        target=lambda: outcome.append(_raised(lambda: (w.account(10, rows[10:20]), w.account(0, rows[0:10])))),
        daemon=True,
    )
    hasher.start()
    w.abort()  # what the sink does after an error (its _fail only cancels: other threads may still write)
    hasher.join(5)
    assert not hasher.is_alive(), "the hash thread still waits for rows that will never be placed"
    assert outcome == ["a.safetensors: rows 10..20 were never placed (cancelled)"]
    assert list(tmp_path.iterdir()) == []


def test_positional_writer_is_not_sealed_before_every_row_was_placed(tmp_path):
    rows = rows_tensor(10, 0).view(torch.uint8).numpy()
    w = PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "bfloat16", (10, H))
    w.place(0, rows[0:4])
    w.account(0, rows[0:4])
    w.account(4, rows[4:10])  # hashed from memory, but the write thread has not placed it
    with pytest.raises(ValueError, match=r"rows 4\.\. never arrived"):
        w.seal()
    assert list(tmp_path.iterdir()) == []


# ---- BackgroundFlush (through the positional writer) ---------------------------------------------
def test_background_flushes_run_while_rows_arrive_and_change_no_byte(tmp_path, monkeypatch):
    calls = []
    real = shard_files.os.fdatasync
    monkeypatch.setattr(shard_files.os, "fdatasync", lambda fd: (calls.append(fd), real(fd)))
    total = 64
    rows = rows_tensor(total, 5)
    w = PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "bfloat16", (total, H), sync_bytes=32)
    for a in range(0, total, 4):
        write_rows(w, a, rows[a : a + 4].view(torch.uint8).numpy())
        time.sleep(0.001)  # let the flush thread see the bytes
    entry = w.seal()
    temp_of(tmp_path / "a.safetensors").rename(tmp_path / "a.safetensors")
    assert calls, "no background flush ran"
    ref_bytes, ref_entry = streamed(tmp_path, total, 5)
    assert (tmp_path / "a.safetensors").read_bytes() == ref_bytes
    assert entry == ref_entry


def test_writer_waits_for_the_disk_only_when_too_far_behind(tmp_path, monkeypatch):
    disk = threading.Event()  # the "disk" finishes a flush only when this is set
    monkeypatch.setattr(shard_files.os, "fdatasync", lambda fd: disk.wait())
    path = tmp_path / "f.bin"
    with open(path, "wb", buffering=0) as f:
        flush = BackgroundFlush(f.fileno(), path.name, every=100, max_behind=300)
        flush.wrote(100)  # the flush thread starts its (blocked) flush of these 100 bytes
        flush.wrote(200)  # 300 behind: allowed
        done = threading.Event()
        later = threading.Thread(target=lambda: (flush.wrote(1), done.set()))
        later.start()
        assert not done.wait(0.2), "the writer went more than max_behind ahead of the disk"
        disk.set()  # the disk catches up: the writer goes on
        assert done.wait(5)
        later.join()
        flush.close()
    assert flush.wait_s > 0


def test_a_failed_background_flush_names_the_file(tmp_path, monkeypatch):
    failed = threading.Event()

    def full(fd):
        failed.set()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shard_files.os, "fdatasync", full)
    rows = rows_tensor(8, 0).view(torch.uint8).numpy()
    w = PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "bfloat16", (8, H), sync_bytes=16)
    write_rows(w, 0, rows[0:2])  # reaches `every`: the flush thread runs, and fails
    assert failed.wait(5)
    with pytest.raises(DiskSpaceError, match=r"disk full while writing .*a\.safetensors"):
        write_rows(w, 2, rows[2:8])  # raises here if the thread's error is already recorded...
        w.seal()  # ...else here, after the thread ended
    w.abort()  # what the sink does after any error
    assert list(tmp_path.iterdir()) == []


def test_a_writer_waiting_for_the_disk_is_released_when_the_flush_thread_dies(tmp_path, monkeypatch):
    disk = threading.Event()

    def broken(fd):
        disk.wait()
        raise RuntimeError("the flush thread broke")

    monkeypatch.setattr(shard_files.os, "fdatasync", broken)
    with open(tmp_path / "f.bin", "wb", buffering=0) as f:
        flush = BackgroundFlush(f.fileno(), "f.bin", every=100, max_behind=100)
        flush.wrote(100)  # the thread starts a flush that will fail
        outcome = []
        waiter = threading.Thread(target=lambda: outcome.append(_raised(flush.wrote, 500)))
        waiter.start()  # 600 behind: waits for the disk
        disk.set()
        waiter.join(5)
        assert not waiter.is_alive(), "the writer still waits for a flush thread that is gone"
        assert "the flush thread broke" in outcome[0]
        with pytest.raises(RuntimeError, match="the flush thread broke"):
            flush.close()


def _raised(fn, *args) -> str:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001
        return str(e)
    return ""


# ---- LayerSink --------------------------------------------------------------------------------------
def simulate(sink: LayerSink, lengths: list[int], tags: list[str], budget: int, seed: int) -> None:
    """Feed the sink the steps a chunked-prefill scheduler would run: FCFS, `budget` tokens per step,
    each request's chunks in order, the requests inside a step shuffled (vLLM reorders its batch),
    and a one-token decode step after each prompt (not a prompt row: must be dropped)."""
    rnd = random.Random(seed)
    done = [0] * len(lengths)
    decode_due: list[int] = []
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    while any(d < n for d, n in zip(done, lengths, strict=True)) or decode_due:
        chunks = [(r, done[r], 1) for r in decode_due]  # decode: position = prompt length
        decode_due = []
        room = budget - len(chunks)
        for r, n in enumerate(lengths):
            if room <= 0:
                break
            if done[r] < n:
                take = min(room, n - done[r])
                chunks.append((r, done[r], take))
                done[r] += take
                room -= take
                if done[r] == n:
                    decode_due.append(r)
        rnd.shuffle(chunks)
        segments, start, pieces = [], 0, []
        for r, pos, n in chunks:
            segments.append(Segment(tags[r], pos, start, start + n))
            pieces.append((r, pos, n))
            start += n
        sink.begin_step(segments)
        for lid in LAYERS:
            full = rows_tensor(sum(lengths) + 1, lid)  # +1: a stand-in value for decode rows
            step = torch.cat(
                [
                    full[offsets[r] + pos : offsets[r] + pos + n] if pos < lengths[r] else full[-1:]
                    for r, pos, n in pieces
                ]
            )
            sink.add_layer(lid, step)


def make_sink(tmp_path, lengths, slots=2, step_tokens=16, sync_bytes=256 << 20, storage="model_dtype"):
    """A sink of rows with these lengths; row i's tag is sink.spec.tag(i) (see tags())."""
    rows = [(sum(lengths[:i]), n) for i, n in enumerate(lengths)]
    paths = {lid: str(tmp_path / layer_file(lid)) for lid in LAYERS}
    spec = SinkSpec(
        paths,
        H,
        "bfloat16",
        rows,
        step_tokens=step_tokens,
        slots=slots,
        sync_bytes=sync_bytes,
        storage=storage_format(storage),
        tag_prefix="row",
    )
    return LayerSink(spec)


def tags(n: int) -> list[str]:
    return [SinkSpec({}, H, "bfloat16", [], step_tokens=8192, slots=3, tag_prefix="row").tag(i) for i in range(n)]


@pytest.mark.parametrize("slots", [1, 3])
def test_sink_writes_what_the_in_order_writer_writes(tmp_path, slots):
    lengths = [5, 40, 1, 17, 33, 2]
    sink = make_sink(tmp_path, lengths, slots=slots, sync_bytes=48)  # a background flush every 3 rows
    simulate(sink, lengths, tags(len(lengths)), budget=16, seed=slots)
    entries = sink.finish()
    total = sum(lengths)
    for lid in LAYERS:
        ref_bytes, ref_entry = streamed(tmp_path, total, lid, storage_format("model_dtype").metadata("bfloat16"))
        assert (tmp_path / layer_file(lid)).read_bytes() == ref_bytes, lid
        assert entries[lid] == ref_entry
        assert torch.equal(load_file(tmp_path / layer_file(lid))["hidden_states"], rows_tensor(total, lid))


def test_sink_steps_larger_than_announced_grow_a_slot(tmp_path):
    lengths = [30, 30]
    sink = make_sink(tmp_path, lengths, slots=1, step_tokens=4)  # the scheduler said 4, steps hold 25
    simulate(sink, lengths, tags(2), budget=25, seed=0)
    assert set(sink.finish()) == set(LAYERS)


def test_sink_reports_a_request_that_is_not_in_the_shard(tmp_path):
    sink = make_sink(tmp_path, [4])
    sink.begin_step([Segment(tags(1)[0], 0, 0, 4), Segment("stranger", 0, 4, 6)])
    for lid in LAYERS:
        sink.add_layer(lid, torch.zeros(6, H, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="'stranger', which is not a row of this shard"):
        sink.finish()
    assert list(tmp_path.iterdir()) == []


def test_sink_reports_rows_that_never_arrived(tmp_path):
    lengths = [4, 6]
    sink = make_sink(tmp_path, lengths)
    sink.begin_step([Segment(tags(2)[1], 0, 0, 6)])  # request 0 never ran
    for lid in LAYERS:
        sink.add_layer(lid, rows_tensor(10, lid)[4:10])
    with pytest.raises(RuntimeError, match=r"got \{0: 0, 3: 0, 5: 0\} contiguous rows of 10"):
        sink.finish()
    assert list(tmp_path.iterdir()) == []


def test_sink_recovers_the_slot_of_a_step_that_failed_midway(tmp_path):
    lengths = [3, 3]
    sink = make_sink(tmp_path, lengths, slots=1)
    sink.begin_step([Segment(tags(1)[0], 0, 0, 3)])
    sink.add_layer(LAYERS[0], rows_tensor(6, LAYERS[0])[:3])  # the forward failed before the deepest layer
    simulate(sink, lengths, tags(2), budget=8, seed=0)  # one slot only: would hang if it leaked
    assert set(sink.finish()) == set(LAYERS)


def test_sink_write_error_is_raised_by_finish_not_inside_the_forward(tmp_path):
    sink = make_sink(tmp_path, [4])
    sink.writers[LAYERS[1]]._f.close()  # the next write to this file fails on the writer thread
    sink.begin_step([Segment(tags(1)[0], 0, 0, 4)])
    for lid in LAYERS:
        sink.add_layer(lid, rows_tensor(4, lid))  # returns normally
    with pytest.raises(ValueError, match="closed file"):
        sink.finish()


def early_then_gap(sink: LayerSink) -> None:
    """Two steps of rows [4, 6, 5]: request 2 first (rows 10..15, early), then requests 0 and 1 (the gap)."""
    t = tags(3)
    sink.begin_step([Segment(t[2], 0, 0, 5)])
    for lid in LAYERS:
        sink.add_layer(lid, rows_tensor(15, lid)[10:15])
    sink.begin_step([Segment(t[0], 0, 0, 4), Segment(t[1], 0, 4, 10)])
    for lid in LAYERS:
        sink.add_layer(lid, rows_tensor(15, lid)[0:10])


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def in_thread(fn) -> tuple[threading.Thread, list]:
    """Run fn on a daemon thread: a test that would hang fails on join(timeout) instead; [result or error]."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_sink_hashes_a_step_while_its_rows_are_written_and_reads_back_only_placed_rows(tmp_path, monkeypatch):
    """Each slot goes to the write and the hash thread at once: with every pwrite held back, the hash threads
    still hash rows 0..10 from memory; rows 10..15 (early) are read back from each file only after their pwrite,
    and no slot goes back to the pool before its rows were written."""
    disk, events, freed = threading.Event(), [], []
    real_pwrite, real_preadv = shard_files.os.pwrite, shard_files.os.preadv

    def pwrite(fd, data, offset):
        disk.wait(10)
        done = real_pwrite(fd, data, offset)
        events.append(("placed", os.fstat(fd).st_ino, offset))
        return done

    def preadv(fd, buffers, offset):
        events.append(("read back", os.fstat(fd).st_ino, offset))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(shard_files.os, "pwrite", pwrite)
    monkeypatch.setattr(shard_files.os, "preadv", preadv)
    sink = make_sink(tmp_path, [4, 6, 5])
    give = sink.pool.give
    sink.pool.give = lambda slot: (freed.append("written" if disk.is_set() else "not written"), give(slot))
    try:
        early_then_gap(sink)
        # The hash threads are done with the first slot and hashed the second one's rows from memory.
        wait_until(lambda: all(w.rows == 10 for w in sink.writers.values()), "the hash threads waited for the disk")
        assert not events  # nothing placed yet, nothing read back
    finally:
        disk.set()
    entries = sink.finish()
    assert freed == ["written", "written"]
    for lid in LAYERS:
        data = (tmp_path / layer_file(lid)).read_bytes()
        assert entries[lid]["sha256"] == hashlib.sha256(data).hexdigest()
        assert entries[lid] == streamed(tmp_path, 15, lid, storage_format("model_dtype").metadata("bfloat16"))[1]
        w, ino = sink.writers[lid], os.stat(tmp_path / layer_file(lid)).st_ino
        early = w._data_start + 10 * w.row_bytes  # rows 10..15
        mine = [(kind, offset) for kind, i, offset in events if i == ino]
        assert mine.index(("placed", early)) < mine.index(("read back", early)), lid


def test_a_write_error_ends_the_hash_thread_waiting_for_its_rows(tmp_path, monkeypatch):
    """Rows 10..15 of one layer never reach its file (a full disk) while its hash thread waits to read them back:
    finish() raises the disk's error, and no thread or temp file is left."""
    disk = threading.Event()
    real_pwrite = shard_files.os.pwrite
    sink = make_sink(tmp_path, [4, 6, 5])
    full = os.stat(sink.writers[LAYERS[1]].tmp).st_ino

    def pwrite(fd, data, offset):
        disk.wait(10)
        if os.fstat(fd).st_ino == full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(shard_files.os, "pwrite", pwrite)
    try:
        early_then_gap(sink)
        wait_until(lambda: all(w.rows == 10 for w in sink.writers.values()), "the hash threads never got to rows 10")
    finally:
        disk.set()
    finisher, outcome = in_thread(sink.finish)
    finisher.join(5)
    assert not finisher.is_alive(), "finish() waits for a hash thread that waits for rows never placed"
    assert isinstance(outcome[0], DiskSpaceError) and layer_file(LAYERS[1]) in str(outcome[0])
    assert list(tmp_path.iterdir()) == []
    assert not any(t.is_alive() for t in sink._threads)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("e3p-flush-")]


def test_sink_seals_its_files_in_parallel(tmp_path, monkeypatch):
    """Every layer's seal (the final fdatasync and fsync) is in progress at once: a barrier of all of them passes."""
    lengths = [5, 9]
    sink = make_sink(tmp_path, lengths, sync_bytes=48)
    simulate(sink, lengths, tags(2), budget=8, seed=0)
    real_seal, together = PositionalSafetensorsWriter.seal, threading.Barrier(len(LAYERS), timeout=5)

    def seal(w):
        together.wait()  # BrokenBarrierError if the seals run one after another
        return real_seal(w)

    monkeypatch.setattr(PositionalSafetensorsWriter, "seal", seal)
    entries = sink.finish()
    for lid in LAYERS:
        assert entries[lid]["sha256"] == hashlib.sha256((tmp_path / layer_file(lid)).read_bytes()).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(layer_file(lid) for lid in LAYERS)


def test_a_failed_seal_drops_every_file_and_raises_the_first_layers_error(tmp_path, monkeypatch):
    """Two files' final fsyncs meet a full disk, while the third file seals: no file stays, nothing is renamed, and
    finish() raises the disk error of the first of the two layers (a user error, as sealing in order raised it)."""
    lengths = [5, 9]
    sink = make_sink(tmp_path, lengths, sync_bytes=48)
    simulate(sink, lengths, tags(2), budget=8, seed=0)
    full = {os.stat(sink.writers[lid].tmp).st_ino for lid in LAYERS[1:]}
    real_fsync, together = shard_files.os.fsync, threading.Barrier(len(LAYERS), timeout=5)

    def fsync(fd):
        together.wait()  # the other seals are in progress too
        if os.fstat(fd).st_ino in full:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(shard_files.os, "fsync", fsync)
    with pytest.raises(DiskSpaceError, match=f"disk full while writing .*{layer_file(LAYERS[1])}"):
        sink.finish()
    assert list(tmp_path.iterdir()) == []
    assert not any(t.is_alive() for t in sink._threads)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("e3p-flush-")]


# ---- ShardWriter with layer files from a LayerSink (in this process or a vLLM worker) ---------------
def test_shard_writer_takes_the_layer_files_of_a_sink(tmp_path):
    lengths = [3, 5]
    index = [IndexEntry(row=0, id="a", offset=0, length=3), IndexEntry(row=1, id="b", offset=3, length=5)]
    writer = ShardWriter(tmp_path, LAYERS, H, "bfloat16", index, storage=storage_format("model_dtype"))
    spec = writer.sink_spec(SinkPlan(8, 3, "row"))
    assert sorted(spec.layer_paths) == LAYERS and spec.rows == [(0, 3), (3, 5)]
    sink = LayerSink(spec)
    list(writer.tee(iter([[[1, 2, 3], [4, 5, 6, 7, 8]]])))
    simulate(sink, lengths, [spec.tag(0), spec.tag(1)], budget=8, seed=1)
    manifest = writer.finish(sink.finish(), manifest_fields(num_hidden_layers=5, hidden_size=H))
    for lid in LAYERS:
        data = (tmp_path / layer_file(lid)).read_bytes()
        assert manifest.files[layer_file(lid)]["sha256"] == hashlib.sha256(data).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(layer_file(i) for i in LAYERS), "token_ids.safetensors", "index.json", "manifest.json"]
    )


def test_shard_writer_refuses_an_entry_that_does_not_match_the_file(tmp_path):
    index = [IndexEntry(row=0, id="a", offset=0, length=4)]
    writer = ShardWriter(tmp_path, LAYERS, H, "bfloat16", index, storage=storage_format("model_dtype"))
    spec = writer.sink_spec(SinkPlan(4, 3, "row"))
    sink = LayerSink(spec)
    list(writer.tee(iter([[[1, 2, 3, 4]]])))
    simulate(sink, [4], [spec.tag(0)], budget=4, seed=0)
    entries = sink.finish()
    entries[LAYERS[0]] = {**entries[LAYERS[0]], "bytes": entries[LAYERS[0]]["bytes"] + 1}
    with pytest.raises(ValueError, match="bytes on disk"):
        writer.finish(entries, manifest_fields(hidden_size=H))
    writer.abort()
    assert list(tmp_path.iterdir()) == []  # abort removed the sink's files too


def test_a_file_that_cannot_be_sealed_leaves_no_thread_and_no_temp_file(tmp_path, monkeypatch):
    lengths = [5, 9]
    sink = make_sink(tmp_path, lengths, sync_bytes=48)
    simulate(sink, lengths, tags(2), budget=8, seed=0)
    real, calls = shard_files.os.fsync, []

    def second_fails(fd):  # the second file's final fsync meets a full disk
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(shard_files.os, "fsync", second_fails)
    with pytest.raises(DiskSpaceError, match="disk full while writing"):
        sink.finish()
    assert list(tmp_path.iterdir()) == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith("e3p-flush-")]


# ---- Scaled storage: encoded in the sink, before the rows reach the host slot ------------------------
SCALED = {"fp8_e4m3": ("float8_e4m3fn", "float32", 1, H + 4), "mxfp4": ("uint8", "uint8", H // 32, H // 2 + H // 32)}


@pytest.mark.parametrize("slots", [1, 3])
@pytest.mark.parametrize("storage", list(SCALED))
def test_scaled_sink_writes_the_rows_encoded(tmp_path, slots, storage):
    """Chunked, shuffled steps through a scaled sink give the file write_layer makes from the whole rows:
    values and scales in place, sha256 over both (the scales hashed last, read back)."""
    values_dtype, scales_dtype, scales_per_row, row_bytes = SCALED[storage]
    lengths = [5, 40, 1, 17, 33, 2]
    sink = make_sink(tmp_path, lengths, slots=slots, sync_bytes=48, storage=storage)
    simulate(sink, lengths, tags(len(lengths)), budget=16, seed=slots)
    entries = sink.finish()
    total = sum(lengths)
    for lid in LAYERS:
        data = (tmp_path / layer_file(lid)).read_bytes()
        write_layer(tmp_path / "ref.safetensors", rows_tensor(total, lid), storage)
        assert data == (tmp_path / "ref.safetensors").read_bytes(), lid
        assert entries[lid]["sha256"] == hashlib.sha256(data).hexdigest() and entries[lid]["bytes"] == len(data)
        assert entries[lid]["dtype"] == values_dtype and entries[lid][SCALES_KEY] == {
            "dtype": scales_dtype,
            "shape": [total, scales_per_row],
        }
        assert len(data) - total * row_bytes < 2048  # values, the scales, the header and its metadata


def test_fp8_positional_writer_needs_each_ranges_scales(tmp_path):
    rows = rows_tensor(10, 0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    after = ("hidden_states_scales", "float32", (10, 1))
    w = PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "float8_e4m3fn", (10, H), after)
    with pytest.raises(ValueError, match="rows of hidden_states_scales expected"):
        w.place(0, rows[0:4])
    with pytest.raises(ValueError, match="12 bytes of hidden_states_scales for 4 rows"):
        w.place(0, rows[0:4], torch.ones(3).numpy().view("uint8"))
    w.abort()


def test_shard_writer_of_an_fp8_shard(tmp_path):
    """Manifest format /2 with its storage entry; a sink that stored the model dtype instead is refused."""
    index = [IndexEntry(row=0, id="a", offset=0, length=3), IndexEntry(row=1, id="b", offset=3, length=5)]
    writer = ShardWriter(tmp_path, LAYERS, H, "bfloat16", index, storage=storage_format("fp8_e4m3"))
    spec = writer.sink_spec(SinkPlan(8, 3, "row"))
    assert spec.storage.name == "fp8_e4m3"
    sink = LayerSink(spec)
    list(writer.tee(iter([[[1, 2, 3], [4, 5, 6, 7, 8]]])))
    simulate(sink, [3, 5], [spec.tag(0), spec.tag(1)], budget=8, seed=1)
    manifest = writer.finish(sink.finish(), manifest_fields(num_hidden_layers=5, hidden_size=H, dtype="bfloat16"))
    assert manifest.format == FORMAT_FP8 and manifest.storage_name == "fp8_e4m3"
    assert manifest.storage["scales"]["granularity"] == "per_token_per_layer"
    assert read_manifest(tmp_path).storage == manifest.storage  # it reads back
    x, back = rows_tensor(8, 3).float(), read_layer(tmp_path / layer_file(3), dtype=torch.float32)
    assert float(((back - x).norm(dim=-1) / x.norm(dim=-1)).max()) < 0.04  # e4m3: 3 mantissa bits

    bf16 = tmp_path / "bf16"
    writer = ShardWriter(bf16, LAYERS, H, "bfloat16", index, storage=storage_format("fp8_e4m3"))
    spec = dataclasses.replace(writer.sink_spec(SinkPlan(8, 3, "row")), storage=storage_format("model_dtype"))
    sink = LayerSink(spec)
    list(writer.tee(iter([[[1, 2, 3], [4, 5, 6, 7, 8]]])))
    simulate(sink, [3, 5], [sink.spec.tag(0), sink.spec.tag(1)], budget=8, seed=1)
    with pytest.raises(ValueError, match="fp8_e4m3 storage"):
        writer.finish(sink.finish(), manifest_fields(hidden_size=H))
    writer.abort()
    assert list(bf16.iterdir()) == []


def test_a_second_tensor_of_other_rows_is_refused_before_any_file(tmp_path):
    after = ("hidden_states_scales", "float32", (9, 1))  # one row short of the tensor it follows
    with pytest.raises(ValueError, match="hidden_states_scales has 9 rows, hidden_states 10"):
        PositionalSafetensorsWriter(tmp_path / "a.safetensors", "hidden_states", "float8_e4m3fn", (10, H), after)
    assert list(tmp_path.iterdir()) == []
