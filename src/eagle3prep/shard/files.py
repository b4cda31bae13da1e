"""Safetensors files written as a stream (DESIGN.md §4): rows appended in order, or placed by position.

The total token count is known before the first forward (it is in the tokenized shard), so each
file's header is written first and the rows follow batch by batch: host memory is bounded by one
batch, not by the shard. A file appears under its final name only after every row arrived and was
fsynced.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..infra import faults
from ..infra.disk import disk_full_is_user_error
from .formats import DTYPES
from .layout import safetensors_header, temp_of

if TYPE_CHECKING:
    import torch


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


class StreamingSafetensorsWriter:
    """Writes one tensor of a known shape into a safetensors file, chunk by chunk along dim 0.

    The file appears under its final name only in finish(), after every row arrived and was fsynced.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        after: tuple[str, str, tuple[int, ...]] | None = None,
        metadata: dict[str, str] | None = None,
    ):
        """`after`: (name, dtype, shape) of a second tensor stored behind this one (FP8 scales), whose
        rows match this tensor's; only PositionalSafetensorsWriter fills it. `metadata`: the header's
        `__metadata__` (a layer file's: StorageFormat.metadata)."""
        self.path = Path(path)
        self.dtype = dtype
        self.shape = tuple(shape)
        self.after = after
        self.row_bytes = DTYPES[dtype][1] * int(_prod(self.shape[1:]))
        self.expected_rows = self.shape[0]
        if after is not None and after[2][0] != self.expected_rows:
            raise ValueError(f"{self.path.name}: {after[0]} has {after[2][0]} rows, {name} {self.expected_rows}")
        self.rows = 0
        header = safetensors_header([(name, dtype, self.shape), *([after] if after else [])], metadata)
        self.tmp = temp_of(self.path)
        self._f = open(self.tmp, "wb")  # noqa: SIM115 - closed in finish() or abort()
        self._sha = hashlib.sha256()
        try:
            self._write(header)
        except BaseException:
            self.abort()
            raise

    def _write(self, data: bytes | memoryview) -> None:
        with disk_full_is_user_error(self.path):
            faults.kill_point("shard.write", file=self.path.name, rows=self.rows)  # where a full disk raises
            self._f.write(data)
        self._sha.update(data)

    def append(self, tensor: torch.Tensor) -> None:
        """Append rows; `tensor` is [n, *shape[1:]] in this file's dtype (any device)."""
        if tuple(tensor.shape[1:]) != self.shape[1:]:
            raise ValueError(
                f"{self.path.name}: got rows of shape {tuple(tensor.shape)}, expected [n, {self.shape[1:]}]"
            )
        if str(tensor.dtype).removeprefix("torch.") != self.dtype:
            raise ValueError(f"{self.path.name}: got dtype {tensor.dtype}, expected {self.dtype}")
        if self.rows + tensor.shape[0] > self.expected_rows:
            raise ValueError(f"{self.path.name}: more than the {self.expected_rows} rows declared")
        if self.after is not None:
            raise TypeError(f"{self.path.name}: a file with a second tensor is written by position")
        import torch

        flat = tensor.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
        self._write(memoryview(flat.numpy()))
        faults.kill_point("shard.mid_write", file=self.path.name, rows=self.rows)
        self.rows += tensor.shape[0]

    def seal(self) -> dict[str, Any]:
        """Check the row count and fsync the temp file; return its manifest entry (not renamed yet)."""
        if self.rows != self.expected_rows:
            self.abort()
            raise ValueError(f"{self.path.name}: {self.rows} rows written, {self.expected_rows} declared")
        with disk_full_is_user_error(self.path):  # buffered bytes can meet a full disk only here
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        size = self.tmp.stat().st_size
        entry = {"sha256": self._sha.hexdigest(), "bytes": size, "shape": list(self.shape), "dtype": self.dtype}
        if self.after is not None:
            name, dtype, shape = self.after
            entry[name] = {"dtype": dtype, "shape": list(shape)}
        return entry

    def finish(self) -> dict[str, Any]:
        """seal(), then rename onto the final name; return the file's manifest entry."""
        entry = self.seal()
        os.replace(self.tmp, self.path)
        return entry

    def abort(self) -> None:
        """Drop the temp file. Never raises for a full disk: close() flushes, and that may fail again."""
        if not self._f.closed:
            with contextlib.suppress(OSError):
                self._f.close()
        self.tmp.unlink(missing_ok=True)


# BackgroundFlush defaults. A shorter interval leaves less for finish()'s final fsync, the shard's tail,
# at the same throughput down to 64 MiB (docs/DESIGN.md §5; docs/runs/capture_settings/sink_flush_paced.txt).
FLUSH_EVERY = 64 << 20
# What a read-back of rows that arrived early reads at a time (PositionalSafetensorsWriter._hash_file_range)
READBACK_BYTES = 4 << 20
# How far (per file) the writer may run ahead of the disk before it waits: room for the disk's hiccups.
FLUSH_MAX_BEHIND = 1 << 30


class BackgroundFlush:
    """fdatasync one file from a thread of its own, so whoever writes it hands bytes to the page
    cache and the disk works meanwhile, instead of all at the final fsync.

    The thread flushes whenever `every` bytes were written since its last flush began. The writer
    waits in wrote() only while more than `max_behind` bytes are not yet known to be on disk: then
    the disk sets the pace, and the file's dirty pages stay bounded. A flush's error (EIO, ENOSPC)
    is raised by the next wrote() or by close().
    """

    def __init__(self, fd: int, name: str, every: int = FLUSH_EVERY, max_behind: int = FLUSH_MAX_BEHIND):
        self._fd = fd
        self.every = every
        self.max_behind = max(max_behind, every)
        self._cond = threading.Condition()
        self._written = self._synced = 0
        self._closing = False
        self._stopped = False  # the thread has ended: nobody will flush again
        self._error: BaseException | None = None
        self.flush_s = 0.0  # time the thread spent in fdatasync (off the writer's path)
        self.wait_s = 0.0  # time the writer waited for the disk
        self._thread = threading.Thread(target=self._loop, name=f"e3p-flush-{name}", daemon=True)
        self._thread.start()

    def wrote(self, nbytes: int) -> None:
        """Count `nbytes` just written; wait while too much of the file is not on disk yet."""
        with self._cond:
            self._written += nbytes
            self._cond.notify_all()
            if self._written - self._synced > self.max_behind:
                t0 = time.perf_counter()
                while not self._stopped and self._written - self._synced > self.max_behind:
                    self._cond.wait()
                self.wait_s += time.perf_counter() - t0
            if self._error is not None:
                raise self._error
            if self._stopped and self._written - self._synced > self.max_behind:
                raise RuntimeError("BackgroundFlush: wrote() after close()")

    def close(self) -> None:
        """Stop the thread once its flush in progress is done; raise a flush's error. The caller
        still fsyncs: bytes written since the last flush began are not on disk yet."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._closing and self._written - self._synced < self.every:
                        self._cond.wait()
                    if self._closing:
                        return
                    target = self._written
                t0 = time.perf_counter()
                os.fdatasync(self._fd)
                self.flush_s += time.perf_counter() - t0
                with self._cond:
                    self._synced = target
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised by the writer's next wrote() or by close()
            with self._cond:
                self._error = e
        finally:
            with self._cond:  # a writer waiting for the disk must not wait for a thread that is gone
                self._stopped = True
                self._cond.notify_all()


class PositionalSafetensorsWriter(StreamingSafetensorsWriter):
    """A streaming tensor file whose rows may arrive in any order: place() then account() a range.

    Rows are written where they belong (pwrite); the sha256 still follows file order, so a range
    that arrives early is read back from the file once the gap before it is filled: kept in memory,
    such ranges would add up to a step's rows of every layer to the host's RSS (512 MiB on the 8B shape).
    One thread may place while another accounts the same ranges: the read-back waits until its rows
    are placed, or raises once cancel() says they never will be.
    A range written twice raises, and seal() raises unless every row arrived: a shard with a hole
    never gets a manifest.

    With a second tensor (`after`, the FP8 scales), place() also writes the range's rows of it, and
    seal() hashes that section last by reading it back: it follows every row of the first tensor in
    file order, and keeping it in memory until then would grow with the shard (4 bytes a token).
    """

    def __init__(self, *args: Any, sync_bytes: int | None = None, **kwargs: Any):
        """The base class's arguments, and `sync_bytes`: flush to disk in the background every this many bytes
        (BackgroundFlush), so the disk works while the capture runs (None: only at seal())."""
        self._placed_cond = threading.Condition()  # before the base class, whose errors call abort()
        self._cancelled = False
        super().__init__(*args, **kwargs)
        after = self.after
        self.after_row_bytes = DTYPES[after[1]][1] * int(_prod(after[2][1:])) if after else 0
        try:
            with disk_full_is_user_error(self.path):
                self._f.flush()  # the header; rows go through pwrite on the raw descriptor
        except BaseException:
            self.abort()
            raise
        self._data_start = self._f.tell()
        self._after_start = self._data_start + self.expected_rows * self.row_bytes
        self._early: dict[int, int] = {}  # first row -> rows of a range accounted ahead of `rows`
        self._placed = bytearray(self.expected_rows)  # 1 per placed row: a byte a row, not the row's bytes
        self._readback: memoryview | None = None  # _hash_file_range's buffer, made on its first read
        self._flush = BackgroundFlush(self._f.fileno(), self.path.name, sync_bytes) if sync_bytes else None
        self.write_s = self.hash_s = 0.0  # where this writer's time went (benchmarks)

    @property
    def sync_s(self) -> float:
        """Seconds the background flushes took (the disk's work, off the writer's path)."""
        return self._flush.flush_s if self._flush is not None else 0.0

    @property
    def disk_wait_s(self) -> float:
        """Seconds place() waited for the disk (it had fallen more than BackgroundFlush.max_behind behind)."""
        return self._flush.wait_s if self._flush is not None else 0.0

    def append(self, tensor: torch.Tensor) -> None:
        raise TypeError(f"{self.path.name}: a positional writer takes place() and account(first_row, data)")

    # A range is written by place + account. One thread may place (pwrite, fdatasync: waits on the disk) while
    # another accounts (sha256: waits on a core); they share only _placed, which a read-back waits on.
    def _rows_of(self, first_row: int, data: memoryview | bytes) -> tuple[memoryview, int]:
        data = memoryview(data).cast("B")  # flat bytes, whatever the buffer's shape (C-contiguous)
        if len(data) % self.row_bytes:
            raise ValueError(
                f"{self.path.name}: {len(data)} bytes is not a whole number of {self.row_bytes}-byte rows"
            )
        last = first_row + len(data) // self.row_bytes
        if first_row < 0 or last > self.expected_rows:
            raise ValueError(f"{self.path.name}: rows {first_row}..{last} outside the {self.expected_rows} declared")
        return data, last

    def place(self, first_row: int, data: memoryview | bytes, after: memoryview | bytes | None = None) -> None:
        """pwrite the rows where they belong (the page cache; the background flush takes them to disk);
        `after`: the same rows of the second tensor, required when the file has one."""
        data, last = self._rows_of(first_row, data)
        with self._placed_cond:
            if self._placed.find(1, first_row, last) != -1:
                raise ValueError(f"{self.path.name}: rows {first_row}..{last} written twice")
        faults.kill_point("shard.mid_write", file=self.path.name, rows=first_row)
        if (after is None) != (self.after is None):
            raise ValueError(
                f"{self.path.name}: rows of {self.after[0] if self.after else 'no second tensor'} expected"
            )
        parts = [(data, self._data_start + first_row * self.row_bytes)]
        if after is not None:
            after = memoryview(after).cast("B")
            if len(after) != (last - first_row) * self.after_row_bytes:
                raise ValueError(
                    f"{self.path.name}: {len(after)} bytes of {self.after[0]} for {last - first_row} rows"
                )
            parts.append((after, self._after_start + first_row * self.after_row_bytes))
        t0 = time.perf_counter()
        with disk_full_is_user_error(self.path):
            faults.kill_point("shard.write", file=self.path.name, rows=first_row)  # where a full disk raises
            for view, offset in parts:
                while view:  # pwrite may write less than asked
                    done = os.pwrite(self._f.fileno(), view, offset)
                    view, offset = view[done:], offset + done
            self.write_s += time.perf_counter() - t0
            with self._placed_cond:
                self._placed[first_row:last] = b"\1" * (last - first_row)
                self._placed_cond.notify_all()
            if self._flush is not None:
                self._flush.wrote(sum(len(v) for v, _ in parts))

    def cancel(self) -> None:
        """The rows not placed yet never will be (the placing thread failed): a read-back waiting for them
        raises instead of waiting forever. Touches no file, so any thread may call it at any time."""
        with self._placed_cond:
            self._cancelled = True
            self._placed_cond.notify_all()

    def _wait_placed(self, first_row: int, last: int) -> float:
        """Wait until rows first_row..last-1 are placed (another thread may still be writing them); seconds waited."""
        t0 = time.perf_counter()
        with self._placed_cond:
            while self._placed.find(0, first_row, last) != -1:
                if self._cancelled:
                    raise RuntimeError(f"{self.path.name}: rows {first_row}..{last} were never placed (cancelled)")
                self._placed_cond.wait()
        return time.perf_counter() - t0

    def account(self, first_row: int, data: memoryview | bytes) -> None:
        """Hash the rows in file order; a range that came early is read back from the file once the gap
        before it is filled (waiting until it is placed). Refuse a range seen twice."""
        data, last = self._rows_of(first_row, data)
        taken = [(r, r + n) for r, n in self._early.items()]
        if first_row < self.rows or any(a < last and first_row < b for a, b in taken):
            raise ValueError(f"{self.path.name}: rows {first_row}..{last} written twice")
        if first_row != self.rows:
            self._early[first_row] = last - first_row  # hashed from the file once the gap before it is filled
            return
        t0 = time.perf_counter()
        self._sha.update(data)
        self.rows = last
        while self.rows in self._early:
            n = self._early.pop(self.rows)
            t0 += self._wait_placed(self.rows, self.rows + n)  # waiting is not hashing
            self._hash_file_range(self._data_start + self.rows * self.row_bytes, n * self.row_bytes, "rows")
            self.rows += n
        self.hash_s += time.perf_counter() - t0

    def seal(self) -> dict[str, Any]:
        hole = self.rows if self.rows < self.expected_rows else self._placed.find(0)  # not accounted, or not placed
        if hole != -1:
            self.abort()
            raise ValueError(f"{self.path.name}: rows {hole}.. never arrived ({self.expected_rows} declared)")
        if self._flush is not None:
            try:
                with disk_full_is_user_error(self.path):
                    self._flush.close()
            except BaseException:
                self.abort()
                raise
        if self.after is not None:
            self._hash_after()
        return super().seal()

    def _hash_after(self) -> None:
        """Hash the second tensor's section, read back from the file (every row of it was placed)."""
        try:
            self._hash_file_range(self._after_start, self.expected_rows * self.after_row_bytes, self.after[0])
        except BaseException:
            self.abort()
            raise

    def _hash_file_range(self, pos: int, nbytes: int, what: str) -> None:
        """Hash `nbytes` of the temp file from byte `pos` (placed already: in the page cache, most often), read
        into the writer's one buffer: a new bytes object a read would leave its memory with the allocator."""
        if self._readback is None:
            self._readback = memoryview(bytearray(READBACK_BYTES))
        fd = os.open(self.tmp, os.O_RDONLY)
        try:
            end = pos + nbytes
            while pos < end:
                n = os.preadv(fd, [self._readback[: min(READBACK_BYTES, end - pos)]], pos)
                if not n:
                    raise ValueError(f"{self.path.name}: {what} end at byte {pos}, expected {end}")
                self._sha.update(self._readback[:n])
                pos += n
        finally:
            os.close(fd)

    def abort(self) -> None:
        self.cancel()
        flush = getattr(self, "_flush", None)  # None when the header's write failed in __init__
        if flush is not None:
            with contextlib.suppress(OSError):
                flush.close()  # before the descriptor closes under its fdatasync
        super().abort()
