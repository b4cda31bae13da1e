"""The shard folder's format (DESIGN.md §4): file names, the manifest type, and the readers.

A shard folder holds one `layer_{id}.safetensors` per layer id (tensor `hidden_states`, [sum_T, H]),
`token_ids.safetensors` (tensor `token_ids`, [sum_T] int64), `index.json` and, written last,
`manifest.json`. A folder without a valid manifest is not finished.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import TMP_PREFIX
from ..errors import UserError
from ..records import IndexEntry

MANIFEST = "manifest.json"
INDEX = "index.json"
TOKEN_IDS = "token_ids.safetensors"
LOGPROBS = "logprobs.safetensors"  # the engine's prompt logprobs of a few rows (validate's logits check)
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


def temp_of(path: Path) -> Path:
    """Where a shard file is written before its rename (atomic.remove_stale_temps knows the prefix)."""
    return path.with_name(f"{TMP_PREFIX}{path.name}")


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


@dataclass(slots=True)
class EngineInfo:
    """What a backend's probe found: the manifest records all but the shape and the volatile timings."""

    engine: str
    engine_version: str
    capture_path: str
    tp_size: int
    dtype: str
    num_hidden_layers: int
    hidden_size: int
    final_layer_reachable: bool
    details: dict[str, Any] = field(default_factory=dict)  # engine-specific facts for the manifest
    volatile: dict[str, Any] = field(default_factory=dict)  # differ between runs (timings, GPU ids): timings.json

    def manifest_entry(self) -> dict[str, Any]:
        keys = ("engine", "engine_version", "capture_path", "tp_size", "final_layer_reachable", "dtype")
        return {**{k: getattr(self, k) for k in keys}, **self.details}


@dataclass(slots=True)
class ShardManifest:
    """manifest.json: what the shard holds, what made it, and every data file's sha256 (written last)."""

    shard: int
    layer_ids: list[int]
    layer_id_convention: str
    num_hidden_layers: int
    hidden_size: int
    dtype: str
    rows: int
    tokens: int
    row_range: list[int]
    tokenized: dict[str, str]  # path, sha256 of the tokenized shard it was captured from
    model: dict[str, Any]
    tokenizer: dict[str, Any]
    engine: dict[str, Any]  # EngineInfo.manifest_entry()
    code_version: str
    files: dict[str, dict[str, Any]]  # name -> sha256, bytes (shape, dtype for tensors)
    format: str = FORMAT

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = MANIFEST) -> ShardManifest:
        if data.get("format") != FORMAT:
            raise ValueError(f"{where}: format {data.get('format')!r}, expected {FORMAT!r}")
        try:
            return cls(**data)
        except TypeError as e:  # a key missing or unknown: a damaged or foreign manifest
            raise ValueError(f"{where}: not a shard manifest ({e})") from None


def read_manifest(shard_dir: str | os.PathLike) -> ShardManifest:
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{shard_dir}: no {MANIFEST}, so the shard is not finished (rerun its extract job)")
    with open(path, encoding="utf-8") as f:
        return ShardManifest.from_json(json.load(f), str(path))


def read_index(shard_dir: str | os.PathLike) -> list[IndexEntry]:
    with open(Path(shard_dir) / INDEX, encoding="utf-8") as f:
        return [IndexEntry(**e) for e in json.load(f)]


def index_of_tokenized(tokenized_shard: str | os.PathLike) -> list[IndexEntry]:
    """Where each row of a tokenized shard will sit in the layer files (offsets by seq_len)."""
    index, offset = [], 0
    with open(tokenized_shard, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            index.append(IndexEntry(row=rec["row"], id=rec["id"], offset=offset, length=rec["seq_len"]))
            offset += rec["seq_len"]
    return index
