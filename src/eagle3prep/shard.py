"""Hidden-state shard files (DESIGN.md §4), written as a stream and read back without copies.

A shard folder holds one `layer_{id}.safetensors` per layer id (tensor `hidden_states`, [sum_T, H]),
`token_ids.safetensors` (tensor `token_ids`, [sum_T] int64), `index.json` and, written last,
`manifest.json`. A folder without a valid manifest is not finished.

The total token count is known before the first forward (it is in the tokenized shard), so each
layer file's safetensors header can be written first and the rows appended batch by batch: host
memory is bounded by one batch, not by the shard.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import faults
from .atomic import TMP_PREFIX, fsync_dir, sha256_file, write_json
from .errors import UserError
from .records import IndexEntry

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
INDEX = "index.json"
TOKEN_IDS = "token_ids.safetensors"
TIMINGS = "timings.json"  # wall-clock facts; outside the manifest so equal data gives equal bytes
FORMAT = "eagle3prep.hidden_states/1"

# torch dtype name -> (safetensors dtype code, bytes per element)
DTYPES = {
    "bfloat16": ("BF16", 2),
    "float16": ("F16", 2),
    "float32": ("F32", 4),
    "int64": ("I64", 8),
}


def layer_file(layer_id: int) -> str:
    return f"layer_{layer_id}.safetensors"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as `df -h` prints them)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class DiskSpaceError(UserError, OSError):
    """The output filesystem cannot hold the shard: refused before writing, or full while writing."""


@contextlib.contextmanager
def disk_full_is_user_error(path: Path) -> Iterator[None]:
    """Turn ENOSPC while writing `path` into a DiskSpaceError that names the file and the free space."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        free = shutil.disk_usage(path.parent).free
        raise DiskSpaceError(
            f"disk full while writing {path}: {human_bytes(free)} ({free} bytes) free on its filesystem now; "
            "another job may have used the space since the pre-check. Free space or point results/ at a larger "
            "filesystem, then rerun (`snakemake plan` lists every shard's size)"
        ) from e


class StreamingSafetensorsWriter:
    """Writes one tensor of a known shape into a safetensors file, chunk by chunk along dim 0.

    The file appears under its final name only in finish(), after every row arrived and was fsynced.
    """

    def __init__(self, path: str | os.PathLike, name: str, dtype: str, shape: tuple[int, ...]):
        self.path = Path(path)
        self.dtype = dtype
        self.shape = tuple(shape)
        code, itemsize = DTYPES[dtype]
        self.row_bytes = itemsize * int(_prod(self.shape[1:]))
        self.expected_rows = self.shape[0]
        self.rows = 0
        nbytes = self.row_bytes * self.expected_rows
        header = {name: {"dtype": code, "shape": list(self.shape), "data_offsets": [0, nbytes]}}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the format pads the header to 8-byte alignment
        self.tmp = _temp_of(self.path)
        self._f = open(self.tmp, "wb")  # noqa: SIM115 - closed in finish() or abort()
        self._sha = hashlib.sha256()
        try:
            self._write(struct.pack("<Q", len(blob)) + blob)
        except BaseException:
            self.abort()
            raise

    def _write(self, data: bytes | memoryview) -> None:
        with disk_full_is_user_error(self.path):
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
        return {"sha256": self._sha.hexdigest(), "bytes": size, "shape": list(self.shape), "dtype": self.dtype}

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


# BackgroundFlush defaults. 64 MiB: on the H200 host, at a GPU's pace, the shard's tail (finish())
# was 0.29 s against 0.58 s at 256 MiB, with the same throughput (docs/runs/bench_sink_h200_paced.txt).
FLUSH_EVERY = 64 << 20
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
    """A streaming tensor file whose rows may arrive in any order: write_rows(first_row, bytes).

    Rows are written where they belong (pwrite); the sha256 still follows file order, so a range
    that arrives early is kept in memory until the gap before it is filled (vLLM schedules prompts
    first-come first-served, so that is at most a step's worth). A range written twice raises, and
    seal() raises unless every row arrived: a shard with a hole never gets a manifest.
    """

    def __init__(
        self, path: str | os.PathLike, name: str, dtype: str, shape: tuple[int, ...], sync_bytes: int | None = None
    ):
        """`sync_bytes`: flush to disk in the background every this many bytes (BackgroundFlush), so
        the disk works while the capture runs (None: only at seal())."""
        super().__init__(path, name, dtype, shape)
        try:
            with disk_full_is_user_error(self.path):
                self._f.flush()  # the header; rows go through pwrite on the raw descriptor
        except BaseException:
            self.abort()
            raise
        self._data_start = self._f.tell()
        self._early: dict[int, bytes] = {}  # first row -> bytes of a range that arrived ahead of `rows`
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
        raise TypeError(f"{self.path.name}: a positional writer takes write_rows(first_row, data)")

    def write_rows(self, first_row: int, data: memoryview | bytes) -> None:
        """Write whole rows starting at `first_row`; `data` is their raw bytes in this file's dtype."""
        self.place(first_row, data)
        self.account(first_row, data)

    # write_rows = place + account. They touch disjoint state, so one thread may place (pwrite,
    # fdatasync: waits on the disk) while another accounts (sha256: waits on a core), each in order.
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

    def place(self, first_row: int, data: memoryview | bytes) -> None:
        """pwrite the rows where they belong (the page cache; the background flush takes them to disk)."""
        data, _ = self._rows_of(first_row, data)
        view, offset = data, self._data_start + first_row * self.row_bytes
        t0 = time.perf_counter()
        with disk_full_is_user_error(self.path):
            while view:  # pwrite may write less than asked
                done = os.pwrite(self._f.fileno(), view, offset)
                view, offset = view[done:], offset + done
            self.write_s += time.perf_counter() - t0
            if self._flush is not None:
                self._flush.wrote(len(data))

    def account(self, first_row: int, data: memoryview | bytes) -> None:
        """Hash the rows in file order (keeping a range that came early); refuse a range seen twice."""
        data, last = self._rows_of(first_row, data)
        taken = [(r, r + len(b) // self.row_bytes) for r, b in self._early.items()]
        if first_row < self.rows or any(a < last and first_row < b for a, b in taken):
            raise ValueError(f"{self.path.name}: rows {first_row}..{last} written twice")
        t0 = time.perf_counter()
        if first_row != self.rows:
            self._early[first_row] = bytes(data)  # the caller reuses its buffer
            return
        self._sha.update(data)
        self.rows = last
        while self.rows in self._early:
            early = self._early.pop(self.rows)
            self._sha.update(early)
            self.rows += len(early) // self.row_bytes
        self.hash_s += time.perf_counter() - t0

    def seal(self) -> dict[str, Any]:
        if self.rows != self.expected_rows:
            missing = f"rows {self.rows}.. never arrived" if self.rows < self.expected_rows else ""
            self.abort()
            raise ValueError(f"{self.path.name}: {missing} ({self.expected_rows} declared)")
        if self._flush is not None:
            try:
                with disk_full_is_user_error(self.path):
                    self._flush.close()
            except BaseException:
                self.abort()
                raise
        return super().seal()

    def abort(self) -> None:
        flush = getattr(self, "_flush", None)  # None when the header's write failed in __init__
        if flush is not None:
            with contextlib.suppress(OSError):
                flush.close()  # before the descriptor closes under its fdatasync
        super().abort()


def _temp_of(path: Path) -> Path:
    """Where a shard file is written before its rename (remove_stale_temps knows the prefix)."""
    return path.with_name(f"{TMP_PREFIX}{path.name}")


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


class ShardWriter:
    """Streams a shard: layer files and token ids as batches arrive; index, then manifest, at the end."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        layer_ids: list[int],
        hidden_size: int,
        dtype: str,
        index: list[IndexEntry],
        layers_elsewhere: bool = False,
    ):
        """`layers_elsewhere`: another process (the vLLM worker) writes the layer files' temp files
        (`layer_paths()`, `PositionalSafetensorsWriter`) and hands their entries to `adopt_layers()`;
        this writer still owns the token ids, the index, the renames and the manifest."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.layer_ids = list(layer_ids)
        self.index = index
        self.total_tokens = sum(e.length for e in index)
        self.layers: dict[int, StreamingSafetensorsWriter] = {}
        self.tokens: StreamingSafetensorsWriter | None = None
        self.shape = (self.total_tokens, hidden_size)
        self.dtype = dtype
        self._elsewhere: dict[int, dict[str, Any] | None] = {}  # layer id -> adopted entry
        self._placed: list[Path] = []  # files this writer renamed into place; abort() removes them
        try:
            for lid in self.layer_ids:
                if layers_elsewhere:
                    self._elsewhere[lid] = None
                    continue
                self.layers[lid] = StreamingSafetensorsWriter(
                    self.out_dir / layer_file(lid), "hidden_states", dtype, (self.total_tokens, hidden_size)
                )
            self.tokens = StreamingSafetensorsWriter(
                self.out_dir / TOKEN_IDS, "token_ids", "int64", (self.total_tokens,)
            )
        except BaseException:
            self.abort()
            raise

    def append(self, token_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        """Append one batch: token_ids [n] int64 and {layer_id: [n, H]} for exactly our layer ids."""
        if sorted(hidden) != sorted(self.layer_ids):
            raise ValueError(f"backend returned layers {sorted(hidden)}, expected {self.layer_ids}")
        for lid, t in hidden.items():
            if t.shape[0] != token_ids.shape[0]:
                raise ValueError(f"layer {lid}: {t.shape[0]} token rows for a batch of {token_ids.shape[0]} tokens")
            self.layers[lid].append(t)
        self.tokens.append(token_ids)

    def layer_paths(self) -> dict[int, str]:
        """Final paths of the layer files written elsewhere (their temp files sit beside them)."""
        return {lid: str(self.out_dir / layer_file(lid)) for lid in self._elsewhere}

    def append_tokens(self, token_ids: torch.Tensor) -> None:
        """Append one batch's token ids [n] int64 (layers written elsewhere)."""
        self.tokens.append(token_ids)

    def adopt_layers(self, entries: dict[int, dict[str, Any]]) -> None:
        """Take the sealed (fsynced, not yet renamed) temp files of the layers written elsewhere."""
        if sorted(entries) != sorted(self._elsewhere):
            raise ValueError(f"got entries for layers {sorted(entries)}, expected {sorted(self._elsewhere)}")
        for lid, entry in entries.items():
            tmp = _temp_of(self.out_dir / layer_file(lid))
            size = tmp.stat().st_size if tmp.is_file() else None
            if size != entry["bytes"] or entry["shape"] != list(self.shape) or entry["dtype"] != self.dtype:
                raise ValueError(
                    f"{tmp}: {size} bytes on disk, entry says {entry['bytes']} bytes of {entry['shape']} "
                    f"{entry['dtype']}; expected {list(self.shape)} {self.dtype}"
                )
            self._elsewhere[lid] = entry

    def finish(self, manifest: dict[str, Any], before_manifest=None) -> dict[str, Any]:
        """Rename the data files into place, write index.json, then manifest.json last."""
        files = {}
        for lid, entry in self._elsewhere.items():
            if entry is None:
                raise ValueError(f"layer {lid}: its file, written elsewhere, was never adopted")
            path = self.out_dir / layer_file(lid)
            os.replace(_temp_of(path), path)
            files[path.name] = entry
            self._placed.append(path)
            faults.kill_point("shard.between_files", file=path.name)
        for w in [*self.layers.values(), self.tokens]:
            files[w.path.name] = w.finish()
            self._placed.append(w.path)
            faults.kill_point("shard.between_files", file=w.path.name)
        faults.kill_point("shard.before_index", dir=self.out_dir.name)
        self._placed.append(self.out_dir / INDEX)
        with disk_full_is_user_error(self.out_dir / INDEX):
            write_json(self.out_dir / INDEX, [e.to_json() for e in self.index])
        files[INDEX] = {"sha256": sha256_file(self.out_dir / INDEX), "bytes": (self.out_dir / INDEX).stat().st_size}
        fsync_dir(self.out_dir)
        if before_manifest is not None:
            self._placed.append(self.out_dir / TIMINGS)
            with disk_full_is_user_error(self.out_dir / TIMINGS):
                before_manifest()
        manifest = {
            **manifest,
            "format": FORMAT,
            "files": files,
            "rows": len(self.index),
            "tokens": self.total_tokens,
            "layer_ids": self.layer_ids,
        }
        with disk_full_is_user_error(self.out_dir / MANIFEST):
            write_json(self.out_dir / MANIFEST, manifest)
        self._placed = []  # finished: the files now belong to the manifest
        return manifest

    def abort(self) -> None:
        """Remove every file of the unfinished shard (temp files and those already renamed into place)."""
        for w in [*self.layers.values(), self.tokens]:
            if w is not None:
                w.abort()
        for lid in self._elsewhere:
            _temp_of(self.out_dir / layer_file(lid)).unlink(missing_ok=True)
        for p in self._placed:
            p.unlink(missing_ok=True)
        self._placed = []


def read_manifest(shard_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{shard_dir}: no {MANIFEST}, so the shard is not finished (rerun its extract job)")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def read_index(shard_dir: str | os.PathLike) -> list[IndexEntry]:
    with open(Path(shard_dir) / INDEX, encoding="utf-8") as f:
        return [IndexEntry(**e) for e in json.load(f)]
