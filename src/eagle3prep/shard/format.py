"""The shard folder's format (DESIGN.md §4): file names, the manifest type, and the readers.

A shard folder holds one `layer_{id}.safetensors` per layer id (tensor `hidden_states`, [sum_T, H]),
`token_ids.safetensors` (tensor `token_ids`, [sum_T] int64), `index.json` and, written last,
`manifest.json`. A folder without a valid manifest is not finished.

Storage (`extract.storage`): `model_dtype` keeps `hidden_states` in the capture dtype; `fp8_e4m3`
stores it as float8_e4m3fn followed by `hidden_states_scales` [sum_T, 1] float32, one scale per token
(shard/fp8.py), and marks the manifest with FORMAT_FP8 and its `storage` entry. Every reader goes
through LayerReader / read_layer, which dequantize.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic import TMP_PREFIX
from ..errors import UserError
from ..records import IndexEntry
from .fp8 import FP8_DTYPE, FP8_MAX, SCALE_MIN, SCALES_KEY, dequantize_fp8

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
INDEX = "index.json"
TOKEN_IDS = "token_ids.safetensors"
LOGPROBS = "logprobs.safetensors"  # the engine's prompt logprobs of a few rows (validate's logits check)
TIMINGS = "timings.json"  # wall-clock facts; outside the manifest so equal data gives equal bytes
FORMAT = "eagle3prep.hidden_states/1"
# FP8 layer files hold a second tensor and a dtype older readers would misread: they refuse /2 by name.
FORMAT_FP8 = "eagle3prep.hidden_states/2"

# torch dtype name -> (safetensors dtype code, bytes per element)
DTYPES = {
    "bfloat16": ("BF16", 2),
    "float16": ("F16", 2),
    "float32": ("F32", 4),
    "int64": ("I64", 8),
    FP8_DTYPE: ("F8_E4M3", 1),
}

MODEL_DTYPE, FP8_E4M3 = "model_dtype", "fp8_e4m3"
IMAGE_BACKENDS = ("hf", "vllm")  # extract backends that capture rows with images (tokenization/row_inputs.py)
STORAGES = (MODEL_DTYPE, FP8_E4M3)


def check_storage(storage: str) -> str:
    if storage not in STORAGES:
        raise ValueError(f"extract.storage = {storage!r} is not one of {list(STORAGES)}")
    return storage


def layer_tensors(storage: str, tokens: int, hidden_size: int, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of each tensor of a layer file, in file order: the values, then any scales."""
    if check_storage(storage) == FP8_E4M3:
        return [("hidden_states", FP8_DTYPE, (tokens, hidden_size)), (SCALES_KEY, "float32", (tokens, 1))]
    return [("hidden_states", dtype, (tokens, hidden_size))]


def token_bytes(storage: str, hidden_size: int, dtype: str) -> int:
    """Bytes one token takes in one layer file (values and scale)."""
    return sum(DTYPES[d][1] * math.prod(shape[1:]) for _, d, shape in layer_tensors(storage, 1, hidden_size, dtype))


def storage_entry(storage: str) -> dict[str, Any] | None:
    """The manifest's `storage` field: None (left out) for model-dtype shards, so their manifests stay as they were."""
    if check_storage(storage) == MODEL_DTYPE:
        return None
    return {
        "name": FP8_E4M3,
        "dtype": FP8_DTYPE,
        "scales": {
            "key": SCALES_KEY,
            "dtype": "float32",
            "granularity": "per_token_per_layer",  # one scale per token in each layer file
            "math": f"scale = max(amax / {FP8_MAX:g}, {SCALE_MIN:g}); value = fp8 x scale (speculators' fp8_utils)",
        },
    }


def safetensors_header(tensors: list[tuple[str, str, tuple[int, ...]]]) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file holding `tensors` back to back."""
    header, offset = {}, 0
    for name, dtype, shape in tensors:
        nbytes = DTYPES[dtype][1] * math.prod(shape)
        header[name] = {"dtype": DTYPES[dtype][0], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8-byte alignment
    return struct.pack("<Q", len(blob)) + blob


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
    storage: dict[str, Any] | None = None  # storage_entry(): None = hidden_states in `dtype`

    @property
    def storage_name(self) -> str:
        return (self.storage or {}).get("name", MODEL_DTYPE)

    def layer_files_match(self) -> tuple[bool, str]:
        """The manifest lists one layer file per layer id, and no other: (ok, detail)."""
        layers = sorted(n for n in self.files if n.startswith("layer_"))
        want = sorted(layer_file(i) for i in self.layer_ids)
        return layers == want, f"{layers} vs layer ids {self.layer_ids}"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.storage is None:
            del out["storage"]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = MANIFEST) -> ShardManifest:
        if data.get("format") not in (FORMAT, FORMAT_FP8):
            raise ValueError(f"{where}: format {data.get('format')!r}, expected {FORMAT!r} or {FORMAT_FP8!r}")
        try:
            m = cls(**data)
        except TypeError as e:  # a key missing or unknown: a damaged or foreign manifest
            raise ValueError(f"{where}: not a shard manifest ({e})") from None
        if (m.format == FORMAT_FP8) != (m.storage_name == FP8_E4M3):
            raise ValueError(f"{where}: format {m.format!r} with storage {m.storage_name!r}")
        return m


def check_listed_file(path: Path, entry: dict[str, Any]) -> tuple[bool, str]:
    """One file against its manifest entry ({"sha256", "bytes"}, as shard and export manifests list them):
    (ok, detail). Size first: a truncated file is named as such without reading it."""
    from ..atomic import sha256_file

    if not path.is_file():
        return False, "listed in the manifest but missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return False, f"{size} bytes, manifest says {entry['bytes']} (truncated?)"
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        return False, f"sha256 {digest[:12]} != {entry['sha256'][:12]}"
    return True, "sha256 matches"


# Files a finished shard folder may hold besides those its manifest lists (.snakemake_timestamp:
# Snakemake's marker in directory() outputs).
SHARD_EXTRAS = frozenset({MANIFEST, TIMINGS, ".snakemake_timestamp"})


def stray_files(folder: Path, listed: set[str], extras: frozenset[str] = SHARD_EXTRAS) -> list[str]:
    """Files under `folder` (paths relative to it) that are neither listed nor expected extras."""
    on_disk = (str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    return sorted(name for name in on_disk if name not in listed and name not in extras)


def read_manifest(shard_dir: str | os.PathLike) -> ShardManifest:
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{shard_dir}: no {MANIFEST}, so the shard is not finished (rerun its extract job)")
    with open(path, encoding="utf-8") as f:
        return ShardManifest.from_json(json.load(f), str(path))


def read_index(shard_dir: str | os.PathLike) -> list[IndexEntry]:
    with open(Path(shard_dir) / INDEX, encoding="utf-8") as f:
        return [IndexEntry(**e) for e in json.load(f)]


def index_of_tokenized(tokenized_shard: str | os.PathLike, backend: str | None = None) -> list[IndexEntry]:
    """Where each row of a tokenized shard will sit in the layer files (offsets by seq_len). A row with images
    is refused unless `backend` is one that feeds them to the vision encoder (IMAGE_BACKENDS)."""
    index, offset = [], 0
    with open(tokenized_shard, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "images" in rec and backend not in IMAGE_BACKENDS:  # input_ids alone embed image tokens as text
                raise UserError(
                    f"{tokenized_shard}: row {rec['row']} has images; extract.backend {backend} does not feed images "
                    f"to the vision encoder yet (issue #28 item 3): use extract.backend {' or '.join(IMAGE_BACKENDS)}"
                    ", or list text-only sources in data.sources"
                )
            index.append(IndexEntry(row=rec["row"], id=rec["id"], offset=offset, length=rec["seq_len"]))
            offset += rec["seq_len"]
    return index


class LayerReader:
    """One layer file open for reading rows (memory-mapped); FP8 files are dequantized on read.

    The file says how it is stored (a `hidden_states_scales` tensor = FP8), so any layer file reads the
    same way: `rows(a, b)` is [b - a, H]; `dtype` None gives a model-dtype file as stored and an FP8
    file as bfloat16 (what trainers read); validation asks for float32.
    """

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        self._f = safe_open(str(path), framework="pt")
        self.values = self._f.get_slice("hidden_states")
        self.scales = self._f.get_slice(SCALES_KEY) if SCALES_KEY in self._f.keys() else None  # noqa: SIM118

    @property
    def fp8(self) -> bool:
        return self.scales is not None

    @property
    def shape(self) -> list[int]:
        return self.values.get_shape()

    def rows(self, a: int, b: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.scales is None:
            x = self.values[a:b]
            return x if dtype is None else x.to(dtype)
        import torch

        return dequantize_fp8(self.values[a:b], self.scales[a:b], dtype or torch.bfloat16)


def read_layer(path: str | os.PathLike, a: int = 0, b: int | None = None, dtype: torch.dtype | None = None):
    """Rows a..b-1 of a layer file ([b - a, H]; all rows when b is None), dequantized (LayerReader.rows)."""
    reader = LayerReader(path)
    return reader.rows(a, reader.shape[0] if b is None else b, dtype)
