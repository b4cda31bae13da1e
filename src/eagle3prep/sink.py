"""Forward-step rows straight into a shard's layer files, off the GPU's critical path (DESIGN.md §5).

The vLLM hooks capture path runs this inside TP rank 0's worker. For every forward step:

    sink.begin_step(segments)        # which rows of the step belong to which request, at which position
    sink.add_layer(layer_id, stream) # per requested layer: [step_tokens, H] on the GPU (or CPU)

Each step's layers are copied into one host slot (pinned memory, on a side CUDA stream, so the copy
overlaps the next layers' compute); when the deepest layer is in, the slot goes to the writer
threads (per layer file: one waits for the copy and writes each request's rows where they belong,
`PositionalSafetensorsWriter.place`, while a third flushes the file to disk in the background; the
other hashes them in file order, `.account`). A fixed pool
of slots bounds host memory whatever the shard size: when the writers fall behind, begin_step waits
for a free slot (the disk then sets the pace). finish() drains the writers, checks every row of
every request arrived exactly once and fsyncs; the driver renames the files into place and writes
the manifest.

Errors on a writer thread (a full disk) do not raise inside vLLM's forward: the sink stops
writing, and finish() raises them with the file name.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .shard import FLUSH_EVERY, PositionalSafetensorsWriter

if TYPE_CHECKING:
    import torch

    from .vllm_compat import Segment


@dataclass(frozen=True, slots=True)
class RowPlacement:
    """Where one request's rows go: its first row in the shard and its prompt length."""

    offset: int
    length: int


@dataclass(slots=True)
class _Slot:
    host: torch.Tensor  # [num_layers, capacity, H] (pinned when the rows come from a GPU)
    event: Any = None  # CUDA event recorded after the step's last copy; None on CPU
    pieces: list[tuple[int, int, int]] | None = None  # (src_row, dest_row, n) of this step
    pending: int = 0  # layer threads that have not written their part of this slot yet


class SlotPool:
    """At most `size` host slots of [num_layers, >= step_tokens, H]; kept across shards by the worker
    (pinning 3 x 512 MiB takes a noticeable fraction of a second). take() waits when all are in use."""

    def __init__(self, num_layers: int, hidden_size: int, dtype: torch.dtype, step_tokens: int, size: int = 3):
        self.key = (num_layers, hidden_size, dtype, step_tokens, size)
        self._free: queue.Queue[_Slot] = queue.Queue()
        self._made = 0

    def take(self, tokens: int) -> _Slot:
        num_layers, _, _, step_tokens, size = self.key
        if self._free.empty() and self._made < size:
            self._made += 1
            return self._new(max(tokens, step_tokens))
        slot = self._free.get()  # waits while every slot is with the writers: the disk sets the pace
        return slot if slot.host.shape[1] >= tokens else self._new(tokens)  # a step larger than announced

    def give(self, slot: _Slot) -> None:
        slot.event, slot.pieces, slot.pending = None, None, 0
        self._free.put(slot)

    def _new(self, capacity: int) -> _Slot:
        import torch

        num_layers, hidden_size, dtype, _, _ = self.key
        pinned = torch.cuda.is_available()
        return _Slot(torch.empty((num_layers, capacity, hidden_size), dtype=dtype, pin_memory=pinned))


class ShardSink:
    """Writes the rows of forward steps into one shard's layer files (temp names; see module doc).

    Three threads per layer file (pwrite, fdatasync and sha256 release the GIL): one writes the rows
    where they belong (into the page cache); one flushes the file to disk every `sync_bytes`
    (BackgroundFlush), so the disk works while the GPU does and the final fsync has little left to
    do; one hashes the rows in file order, so the disk never waits for a hash. A slot is free again
    once every file's rows are hashed.
    """

    def __init__(
        self,
        layer_paths: dict[int, str],
        hidden_size: int,
        dtype: str,
        rows: dict[str, RowPlacement],
        total_tokens: int,
        step_tokens: int,
        slots: int = 3,
        pool: SlotPool | None = None,
        sync_bytes: int = FLUSH_EVERY,
    ):
        import torch

        self.layer_ids = sorted(layer_paths)
        self._slot_of_layer = {lid: j for j, lid in enumerate(self.layer_ids)}
        self.rows = rows
        self.total_tokens = total_tokens
        self.pool = pool or SlotPool(len(self.layer_ids), hidden_size, getattr(torch, dtype), step_tokens, slots)
        self.writers: dict[int, PositionalSafetensorsWriter] = {}
        try:
            for lid, p in layer_paths.items():
                self.writers[lid] = PositionalSafetensorsWriter(
                    Path(p), "hidden_states", dtype, (total_tokens, hidden_size), sync_bytes=sync_bytes
                )
        except BaseException:
            for w in self.writers.values():  # no flush thread or temp file left behind
                w.abort()
            raise
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._current: _Slot | None = None
        self._stream = None  # side CUDA stream for device-to-host copies, made on first GPU tensor
        self.stall_s = 0.0  # forward time spent waiting for a free slot (the writers were behind)
        self._todo: dict[int, queue.Queue[_Slot | None]] = {lid: queue.Queue() for lid in self.layer_ids}
        self._to_hash: dict[int, queue.Queue[_Slot | None]] = {lid: queue.Queue() for lid in self.layer_ids}
        self._threads = [
            threading.Thread(target=loop, args=(lid,), name=f"e3p-sink-{kind}-{lid}", daemon=True)
            for lid in self.layer_ids
            for kind, loop in (("write", self._write_loop), ("hash", self._hash_loop))
        ]
        for t in self._threads:
            t.start()

    # ---- forward side (the worker's main thread, inside vLLM's forward) --------------------------
    def begin_step(self, segments: list[Segment]) -> None:
        """Start a step: map its segments to shard rows; take a free host slot."""
        pieces = []
        for seg in segments:
            place = self.rows.get(seg.tag)
            if place is None:
                self._fail(RuntimeError(f"the step holds request {seg.tag!r}, which is not a row of this shard"))
                continue
            n = min(seg.end - seg.start, place.length - seg.first_pos)
            if n > 0:  # rows past the prompt (the one sampled token's decode step) are not captured
                pieces.append((seg.start, place.offset + seg.first_pos, n))
        # File order: vLLM's persistent batch puts a new request into a freed slot, ahead of an older
        # request's next chunk; in file order, the older rows come first and nothing waits in memory.
        pieces.sort(key=lambda p: p[1])
        if self._current is not None:  # the previous step never reached its deepest layer (it failed)
            self.pool.give(self._current)
        self._current = None
        if not pieces or self._error is not None:
            return
        t0 = time.perf_counter()
        slot = self.pool.take(max(src + n for src, _, n in pieces))
        self.stall_s += time.perf_counter() - t0
        slot.pieces = pieces
        self._current = slot

    def add_layer(self, layer_id: int, stream: torch.Tensor) -> None:
        """One requested layer of the current step, [step_tokens, H]; must not be mutated later
        (callers pass a fresh tensor, e.g. hidden + residual). The deepest layer ends the step."""
        slot = self._current
        if slot is None:
            return
        import torch

        n = min(stream.shape[0], slot.host.shape[1])
        dest = slot.host[self._slot_of_layer[layer_id], :n]
        if stream.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=stream.device)
            compute = torch.cuda.current_stream(stream.device)
            self._stream.wait_stream(compute)  # the stream's value is computed before we copy it
            with torch.cuda.stream(self._stream):
                dest.copy_(stream[:n], non_blocking=True)
            stream.record_stream(self._stream)  # the allocator keeps it until the copy ran
        else:
            dest.copy_(stream[:n])
        if layer_id == self.layer_ids[-1]:
            if stream.is_cuda:
                slot.event = torch.cuda.Event()
                slot.event.record(self._stream)
            self._current = None
            slot.pending = len(self.layer_ids)
            for q in self._todo.values():
                q.put(slot)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error

    # ---- writer threads: per layer file, one places the rows (disk), one hashes them (a core) ---
    def _write_loop(self, layer_id: int) -> None:
        import torch

        j, writer = self._slot_of_layer[layer_id], self.writers[layer_id]
        while True:
            slot = self._todo[layer_id].get()
            if slot is None:
                self._to_hash[layer_id].put(None)
                return
            try:
                if self._error is None:
                    if slot.event is not None:
                        slot.event.synchronize()  # the step's device-to-host copies are done
                    raw = slot.host[j].view(torch.uint8)  # [capacity, H * itemsize]
                    for src, dest, n in slot.pieces:
                        writer.place(dest, raw[src : src + n].numpy())
            except BaseException as e:  # noqa: BLE001 - reported by finish()
                self._fail(e)
            self._to_hash[layer_id].put(slot)  # the hash thread frees the slot, error or not

    def _hash_loop(self, layer_id: int) -> None:
        import torch

        j, writer = self._slot_of_layer[layer_id], self.writers[layer_id]
        while True:
            slot = self._to_hash[layer_id].get()
            if slot is None:
                return
            try:
                if self._error is None:
                    raw = slot.host[j].view(torch.uint8)
                    for src, dest, n in slot.pieces:
                        writer.account(dest, raw[src : src + n].numpy())
            except BaseException as e:  # noqa: BLE001 - reported by finish()
                self._fail(e)
            finally:
                with self._lock:
                    slot.pending -= 1
                    last = slot.pending == 0
                if last:
                    self.pool.give(slot)

    # ---- end -----------------------------------------------------------------------------------
    def finish(self) -> dict[int, dict[str, Any]]:
        """Drain the writers, check every row arrived, fsync; {layer_id: manifest entry} of the temp files."""
        self._stop()
        if self._error is not None:
            self.abort()
            raise self._error
        missing = [lid for lid, w in self.writers.items() if w.rows != self.total_tokens]
        if missing:
            got = {lid: self.writers[lid].rows for lid in missing}
            self.abort()
            raise RuntimeError(
                f"the shard's layer files got {got} contiguous rows of {self.total_tokens}: a request's rows "
                "never arrived (prefix caching must be off and every forward step captured)"
            )
        try:
            return {lid: w.seal() for lid, w in self.writers.items()}
        except BaseException:
            self.abort()  # the files not sealed yet still hold flush threads and temp files
            raise

    def stats(self) -> dict[str, float]:
        """Seconds: forward stalled for a slot; per-file busiest writer in pwrite, sha256, background
        flushes, and waiting for the disk (it was behind by more than BackgroundFlush.max_behind)."""
        keys = ("write_s", "hash_s", "sync_s", "disk_wait_s")
        busiest = {k: max(getattr(w, k) for w in self.writers.values()) for k in keys}
        return {"stall_s": round(self.stall_s, 3), **{k: round(v, 3) for k, v in busiest.items()}}

    def abort(self) -> None:
        """Stop and drop the temp files."""
        self._stop()
        for w in self.writers.values():
            w.abort()

    def _stop(self) -> None:
        if any(t.is_alive() for t in self._threads):
            for lid in self.layer_ids:
                self._todo[lid].put(None)  # each write thread passes it on to its hash thread
        for t in self._threads:
            t.join()
