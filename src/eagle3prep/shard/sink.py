"""The one way hidden states reach a shard's layer files: forward steps into a LayerSink (DESIGN.md §5).

Every backend speaks it, in the process that holds the rows: the hf backend in its own process, both
vLLM capture paths in TP rank 0's worker (the hooks per forward step, the built-in path's connector
per step's finished requests).

    sink.begin_step(segments)        # which rows of the step belong to which request, at which position
    sink.add_layer(layer_id, stream) # per requested layer: [step_tokens, H] on the GPU (or CPU)
    sink.finish()                    # every row arrived exactly once: fsync, rename, {layer_id: entry}

Rows are copied into a pooled host slot (pinned, on a side CUDA stream, so the copy overlaps the next
layers' compute); writer threads place them by position and, at the same time, hash them in file order
(docs/DESIGN.md §5 has the decisions behind the slot count and the flush interval). With
a scaled `storage` (fp8_e4m3, mxfp4) each layer is encoded on its own device first, on the same side stream,
so only the stored bytes cross to the host and reach the disk (shard/formats.py; on a CPU it is the same code).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import schema_default
from ..infra import faults
from .files import FLUSH_EVERY, PositionalSafetensorsWriter
from .formats import DTYPES, StorageFormat, storage_format

if TYPE_CHECKING:
    import torch


# Ends the tag of a logits-check row's prefix request (vllm/capture/requests.logprob_request): the engine computes
# its tokens for their prompt logprobs alone, so a sink skips them rather than refusing a request it does not know.
PROBE_SUFFIX = "-lp"


@dataclass(frozen=True, slots=True)
class Segment:
    """The tokens of one request inside one flattened forward step."""

    tag: str  # the request's tag (SinkSpec.tag(i) for shard row i)
    first_pos: int  # position of the segment's first token within its request (> 0 for a later chunk)
    start: int  # first row of the segment in the step's [num_tokens, H] hidden states
    end: int  # one past its last row


@dataclass(frozen=True, slots=True)
class SinkPlan:
    """What a probed backend reports for its next capture; with the shard's layout it makes the SinkSpec."""

    step_tokens: int  # the largest forward step the backend will hand over: the host slots' size
    slots: int  # host slots: one being filled, the rest with the writer threads
    tag_prefix: str  # of the capture's request tags; a vLLM engine needs a new one per capture


@dataclass(frozen=True, slots=True)
class SinkSpec:
    """Everything a LayerSink needs, plain data so it can travel to a vLLM worker by RPC (the storage by its name:
    vllm/capture/message.py)."""

    layer_paths: dict[int, str]  # final path of each layer file
    hidden_size: int
    dtype: str
    rows: list[tuple[int, int]]  # (offset, length) of each shard row, in index order
    step_tokens: int  # the largest forward step expected: the host slots' size (SinkPlan)
    slots: int
    tag_prefix: str
    sync_bytes: int = FLUSH_EVERY
    logprob_rows: tuple[int, ...] = ()  # rows whose prompt logprobs the engine also returns (logits check)
    storage: StorageFormat = storage_format(schema_default("extract", "storage"))

    @property
    def total_tokens(self) -> int:
        return sum(n for _, n in self.rows)

    def tag(self, i: int) -> str:
        return f"{self.tag_prefix}-{i}"


@dataclass(slots=True)
class _Slot:
    host: torch.Tensor  # [num_layers, capacity, W] stored values (pinned when the rows come from a GPU)
    scales: torch.Tensor | None = None  # [num_layers, capacity, G]: a scaled storage's scales of each row
    event: Any = None  # CUDA event recorded after the step's last copy; None on CPU
    pieces: list[tuple[int, int, int]] | None = None  # (src_row, dest_row, n) of this step
    pending: int = 0  # write and hash threads (two a layer) not yet done with this slot


class SlotPool:
    """At most `size` host slots of [num_layers, >= step_tokens, H]; kept across shards by the vLLM
    worker (pinning 3 x 512 MiB takes a noticeable fraction of a second). take() waits when all are in use."""

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        dtype: str,
        step_tokens: int,
        size: int,
        storage: StorageFormat,
    ):
        """`dtype`: the rows' model dtype; `storage`: the slot holds that format's stored tensors of each row."""
        self.key = (num_layers, hidden_size, dtype, step_tokens, size, storage)
        self._free: queue.Queue[_Slot] = queue.Queue()
        self._made = 0

    def take(self, tokens: int) -> _Slot:
        _, _, _, step_tokens, size, _ = self.key
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

        num_layers, hidden_size, dtype, _, _, storage = self.key
        pinned = torch.cuda.is_available()
        parts = []
        for _, part_dtype, (_, width) in storage.tensors(1, hidden_size, dtype):
            # Pinned as bytes and viewed as the stored dtype: a same-dtype copy_ into it is a plain byte copy.
            raw = torch.empty(
                (num_layers, capacity, width * DTYPES[part_dtype][1]), dtype=torch.uint8, pin_memory=pinned
            )
            parts.append(raw.view(getattr(torch, part_dtype)))
        return _Slot(*parts)


def _pool_key(spec: SinkSpec) -> tuple:
    return (len(spec.layer_paths), spec.hidden_size, spec.dtype, spec.step_tokens, spec.slots, spec.storage)


def pool_for(spec: SinkSpec) -> SlotPool:
    """A new pool sized for `spec` (a worker keeps it for the next shard of the same shape)."""
    return SlotPool(*_pool_key(spec))


class LayerSink:
    """Writes the rows of forward steps into one shard's layer files.

    Two threads per layer file (pwrite and sha256 release the GIL), both handed each step's slot at once:
    one places the rows where they belong while the other hashes them in file order (a range it reads
    back from the file waits until it is placed); each file's BackgroundFlush takes them to disk meanwhile.
    A slot goes back to the pool once every thread is done with it. Errors on a thread (a full disk)
    never raise inside the forward: finish() raises them. finish() seals the files in parallel, so
    their final fsyncs overlap.
    """

    def __init__(self, spec: SinkSpec, pool: SlotPool | None = None):
        self.spec = spec
        self.layer_ids = sorted(spec.layer_paths)
        self._slot_of_layer = {lid: j for j, lid in enumerate(self.layer_ids)}
        self.rows = {spec.tag(i): place for i, place in enumerate(spec.rows)}
        self.total_tokens = spec.total_tokens
        self.pool = pool if pool is not None and pool.key == _pool_key(spec) else pool_for(spec)
        self.writers: dict[int, PositionalSafetensorsWriter] = {}
        (name, dtype, shape), *after = spec.storage.tensors(self.total_tokens, spec.hidden_size, spec.dtype)
        try:
            for lid in self.layer_ids:
                path = Path(spec.layer_paths[lid])
                self.writers[lid] = PositionalSafetensorsWriter(
                    path, name, dtype, shape, after[0] if after else None, sync_bytes=spec.sync_bytes,
                    metadata=spec.storage.metadata(spec.dtype),
                )  # fmt: skip
        except BaseException:
            for w in self.writers.values():  # no flush thread or temp file left behind
                w.abort()
            raise
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._current: _Slot | None = None
        self._stream = None  # side CUDA stream for device-to-host copies, made on first GPU tensor
        self.stall_s = 0.0  # forward time spent waiting for a free slot (the writers were behind)
        self.steps = 0  # forward steps begun: a kill point's place inside the shard (infra/faults.py)
        self._dir = Path(next(iter(spec.layer_paths.values()))).parent.name if spec.layer_paths else ""
        self._queues: list[queue.Queue[_Slot | None]] = []  # one a thread: each gets every step's slot
        self._threads = []
        for lid in self.layer_ids:
            for kind, work in (("write", self._place), ("hash", self._account)):
                self._queues.append(queue.Queue())
                args, name = (self._queues[-1], partial(work, lid)), f"e3p-sink-{kind}-{lid}"
                self._threads.append(threading.Thread(target=self._loop, args=args, name=name, daemon=True))
        for t in self._threads:
            t.start()

    # ---- forward side ---------------------------------------------------------------------------
    def begin_step(self, segments: list[Segment]) -> None:
        """Start a step: map its segments to shard rows; take a free host slot."""
        self.steps += 1
        faults.kill_point("capture.step", dir=self._dir, step=self.steps)  # in the engine's process
        pieces = []
        for seg in segments:
            place = self.rows.get(seg.tag)
            if place is None and seg.tag.endswith(PROBE_SUFFIX) and seg.tag[: -len(PROBE_SUFFIX)] in self.rows:
                continue
            if place is None:
                self._fail(RuntimeError(f"the step holds request {seg.tag!r}, which is not a row of this shard"))
                continue
            offset, length = place
            n = min(seg.end - seg.start, length - seg.first_pos)
            if n > 0:  # rows past the prompt (the one sampled token's decode step) are not captured
                pieces.append((seg.start, offset + seg.first_pos, n))
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
        j = self._slot_of_layer[layer_id]
        if stream.is_cuda:
            self.copy_stream(stream.device).wait_stream(torch.cuda.current_stream(stream.device))  # computed first
            with torch.cuda.stream(self._stream):
                self._to_host(slot, j, stream, n)
            stream.record_stream(self._stream)  # the allocator keeps it until the copy ran
        else:
            self._to_host(slot, j, stream, n)
        if layer_id == self.layer_ids[-1]:
            if stream.is_cuda:
                slot.event = torch.cuda.Event()
                slot.event.record(self._stream)
            self._current = None
            slot.pending = len(self._queues)
            for q in self._queues:
                q.put(slot)

    def copy_stream(self, device: Any) -> Any:
        """The side CUDA stream the rows leave the device on (the built-in path also gathers on it)."""
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _to_host(self, slot: _Slot, j: int, stream: torch.Tensor, n: int) -> None:
        """Rows 0..n-1 of `stream` into layer slot j, encoded first on their device for a scaled storage.
        On a GPU this runs on the side stream; temporaries freed here are reused only by later work on that
        stream, after the copies that read them."""
        if slot.scales is None:
            slot.host[j, :n].copy_(stream[:n], non_blocking=stream.is_cuda)
            return
        fmt = self.spec.storage
        for a in range(0, n, fmt.chunk):
            b = min(a + fmt.chunk, n)
            values, scales = fmt.encode(stream[a:b])
            slot.host[j, a:b].copy_(values, non_blocking=stream.is_cuda)
            slot.scales[j, a:b].copy_(scales.view(b - a, -1), non_blocking=stream.is_cuda)

    def write_rows(self, tag: str, layers: dict[int, torch.Tensor]) -> None:
        """One whole request's rows at once ({layer_id: [T, H]}): a one-segment step (built-in path)."""
        n = next(iter(layers.values())).shape[0]
        self.begin_step([Segment(tag, 0, 0, n)])
        for lid in self.layer_ids:
            self.add_layer(lid, layers[lid])

    @property
    def failure(self) -> str | None:
        """The first error of the shard's capture or writers, as a line; None while none happened. Once set, no
        more rows are placed: the driver stops waiting for them and finish() raises it."""
        error = self._error
        return None if error is None else f"{type(error).__name__}: {error}"

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        for w in self.writers.values():  # a hash thread waiting for rows that will not be placed now raises
            w.cancel()

    # ---- writer threads -------------------------------------------------------------------------
    def _loop(self, todo: queue.Queue[_Slot | None], work: Callable[[_Slot], None]) -> None:
        """One write or hash thread: each slot's part of its layer, in the order the steps came."""
        while (slot := todo.get()) is not None:
            try:
                if self._error is None:
                    if slot.event is not None:
                        slot.event.synchronize()  # the step's device-to-host copies are done
                    work(slot)
            except BaseException as e:  # noqa: BLE001 - reported by finish()
                self._fail(e)
            finally:
                with self._lock:
                    slot.pending -= 1
                    last = slot.pending == 0
                if last:  # error or not: every thread is done with it
                    self.pool.give(slot)

    def _place(self, layer_id: int, slot: _Slot) -> None:
        import torch

        j, writer = self._slot_of_layer[layer_id], self.writers[layer_id]
        raw = slot.host[j].view(torch.uint8)  # [capacity, H * itemsize]
        scales = slot.scales[j].view(torch.uint8) if slot.scales is not None else None  # [capacity, scale bytes]
        for src, dest, n in slot.pieces:
            after = scales[src : src + n].numpy() if scales is not None else None
            writer.place(dest, raw[src : src + n].numpy(), after)

    def _account(self, layer_id: int, slot: _Slot) -> None:
        import torch

        raw = slot.host[self._slot_of_layer[layer_id]].view(torch.uint8)
        for src, dest, n in slot.pieces:
            self.writers[layer_id].account(dest, raw[src : src + n].numpy())

    # ---- end ------------------------------------------------------------------------------------
    def finish(self) -> dict[int, dict[str, Any]]:
        """Drain the writers, check every row arrived, fsync and rename each file into place;
        {layer_id: manifest entry}. The shard is still unfinished until ShardWriter writes the manifest."""
        self._stop()
        if self._error is not None:
            self.abort()
            raise self._error
        missing = {lid: w.rows for lid, w in self.writers.items() if w.rows != self.total_tokens}
        if missing:
            self.abort()
            raise RuntimeError(
                f"the shard's layer files got {missing} contiguous rows of {self.total_tokens}: a request's rows "
                "never arrived (prefix caching must be off and every forward step captured)"
            )
        # In parallel: each seal waits for its file's last fdatasync and fsync, and the disks take them at once.
        with ThreadPoolExecutor(max(1, len(self.writers)), thread_name_prefix="e3p-seal") as seals:
            futures = {lid: seals.submit(w.seal) for lid, w in self.writers.items()}
        errors = [e for f in futures.values() if (e := f.exception()) is not None]
        if errors:
            self.abort()  # the other files, sealed or not, still hold temp files (and flush threads)
            raise errors[0]
        entries = {lid: f.result() for lid, f in futures.items()}
        for w in self.writers.values():
            os.replace(w.tmp, w.path)
        return entries

    def stats(self) -> dict[str, float]:
        """Seconds: forward stalled for a slot; per-file busiest writer in pwrite, sha256, background
        flushes, and waiting for the disk (it was behind by more than BackgroundFlush.max_behind)."""
        keys = ("write_s", "hash_s", "sync_s", "disk_wait_s")
        busiest = {k: max(getattr(w, k) for w in self.writers.values()) for k in keys}
        return {"stall_s": round(self.stall_s, 3), **{k: round(v, 3) for k, v in busiest.items()}}

    def abort(self) -> None:
        """Stop and drop the temp files."""
        for w in self.writers.values():  # no hash thread waits for rows while the threads stop
            w.cancel()
        self._stop()
        for w in self.writers.values():
            w.abort()

    def _stop(self) -> None:
        if any(t.is_alive() for t in self._threads):
            for q in self._queues:
                q.put(None)
        for t in self._threads:
            t.join()
