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
        self.tmp = self.path.with_name(f"{TMP_PREFIX}{self.path.name}")
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

    def finish(self) -> dict[str, Any]:
        """Check the row count, fsync, rename onto the final name; return the file's manifest entry."""
        if self.rows != self.expected_rows:
            self.abort()
            raise ValueError(f"{self.path.name}: {self.rows} rows written, {self.expected_rows} declared")
        with disk_full_is_user_error(self.path):  # buffered bytes can meet a full disk only here
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        size = self.tmp.stat().st_size
        os.replace(self.tmp, self.path)
        return {"sha256": self._sha.hexdigest(), "bytes": size, "shape": list(self.shape), "dtype": self.dtype}

    def abort(self) -> None:
        """Drop the temp file. Never raises for a full disk: close() flushes, and that may fail again."""
        if not self._f.closed:
            with contextlib.suppress(OSError):
                self._f.close()
        self.tmp.unlink(missing_ok=True)


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


class ShardWriter:
    """Streams a shard: layer files and token ids as batches arrive; index, then manifest, at the end."""

    def __init__(
        self, out_dir: str | os.PathLike, layer_ids: list[int], hidden_size: int, dtype: str, index: list[IndexEntry]
    ):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.layer_ids = list(layer_ids)
        self.index = index
        self.total_tokens = sum(e.length for e in index)
        self.layers: dict[int, StreamingSafetensorsWriter] = {}
        self.tokens: StreamingSafetensorsWriter | None = None
        self._placed: list[Path] = []  # files this writer renamed into place; abort() removes them
        try:
            for lid in self.layer_ids:
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

    def finish(self, manifest: dict[str, Any], before_manifest=None) -> dict[str, Any]:
        """Rename the data files into place, write index.json, then manifest.json last."""
        files = {}
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
