"""Forward-step rows straight into a shard's layer files, off the GPU's critical path (DESIGN.md §5).

The vLLM hooks capture path runs this inside TP rank 0's worker. For every forward step:

    sink.begin_step(segments)        # which rows of the step belong to which request, at which position
    sink.add_layer(layer_id, stream) # per requested layer: [step_tokens, H] on the GPU (or CPU)

Each step's layers are copied into one host slot (pinned memory, on a side CUDA stream, so the copy
overlaps the next layers' compute); when the deepest layer is in, the slot goes to a writer thread,
which waits for the copy, then writes each request's rows where they belong in the layer files
(`PositionalSafetensorsWriter`). A fixed pool of slots bounds host memory whatever the shard size:
when the writer falls behind, begin_step waits for a free slot (the disk then sets the pace).
finish() drains the writer, checks every row of every request arrived exactly once and fsyncs;
the driver renames the files into place and writes the manifest.

Errors on the writer thread (a full disk) do not raise inside vLLM's forward: the sink stops
writing, and finish() raises them with the file name.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .shard import PositionalSafetensorsWriter

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


class ShardSink:
    """Writes the rows of forward steps into one shard's layer files (temp names; see module doc)."""

    def __init__(
        self,
        layer_paths: dict[int, str],
        hidden_size: int,
        dtype: str,
        rows: dict[str, RowPlacement],
        total_tokens: int,
        step_tokens: int,
        slots: int = 3,
    ):
        import torch

        self.layer_ids = sorted(layer_paths)
        self._slot_of_layer = {lid: j for j, lid in enumerate(self.layer_ids)}
        self.rows = rows
        self.total_tokens = total_tokens
        self.hidden_size = hidden_size
        self.dtype = getattr(torch, dtype)
        self.step_tokens = step_tokens
        self.num_slots = slots
        self.writers = {
            lid: PositionalSafetensorsWriter(Path(p), "hidden_states", dtype, (total_tokens, hidden_size))
            for lid, p in layer_paths.items()
        }
        self._free: queue.Queue[_Slot] = queue.Queue()
        self._made = 0
        self._todo: queue.Queue[_Slot | None] = queue.Queue()
        self._error: BaseException | None = None
        self._current: _Slot | None = None
        self._stream = None  # side CUDA stream for device-to-host copies, made on first GPU tensor
        self._thread = threading.Thread(target=self._write_loop, name="e3p-shard-sink", daemon=True)
        self._thread.start()

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
        if self._current is not None:  # the previous step never reached its deepest layer (it failed)
            self._free.put(self._current)
        self._current = None
        if not pieces or self._error is not None:
            return
        total = max(src + n for src, _, n in pieces)
        slot = self._take_slot(total)
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
            self._todo.put(slot)

    def _take_slot(self, tokens: int) -> _Slot:

        if self._made < self.num_slots:
            self._made += 1
            return self._new_slot(max(tokens, self.step_tokens))
        slot = self._free.get()  # waits while every slot is with the writer: the disk sets the pace
        if slot.host.shape[1] < tokens:  # a step larger than announced: grow this slot
            slot = self._new_slot(tokens)
        return slot

    def _new_slot(self, capacity: int) -> _Slot:
        import torch

        pinned = torch.cuda.is_available()
        host = torch.empty((len(self.layer_ids), capacity, self.hidden_size), dtype=self.dtype, pin_memory=pinned)
        return _Slot(host)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error

    # ---- writer thread -------------------------------------------------------------------------
    def _write_loop(self) -> None:
        import torch

        while True:
            slot = self._todo.get()
            if slot is None:
                return
            try:
                if self._error is None:
                    if slot.event is not None:
                        slot.event.synchronize()  # the step's device-to-host copies are done
                    raw = slot.host.view(torch.uint8)  # [L, capacity, H * itemsize]
                    for j, lid in enumerate(self.layer_ids):
                        for src, dest, n in slot.pieces:
                            self.writers[lid].write_rows(dest, raw[j, src : src + n].numpy().data)
            except BaseException as e:  # noqa: BLE001 - reported by finish()
                self._fail(e)
            finally:
                slot.event, slot.pieces = None, None
                self._free.put(slot)

    # ---- end -----------------------------------------------------------------------------------
    def finish(self) -> dict[int, dict[str, Any]]:
        """Drain the writer, check every row arrived, fsync; {layer_id: manifest entry} of the temp files."""
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
        return {lid: w.seal() for lid, w in self.writers.items()}

    def abort(self) -> None:
        """Stop and drop the temp files."""
        self._stop()
        for w in self.writers.values():
            w.abort()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._todo.put(None)
            self._thread.join()
