"""A shard's manifest.json (DESIGN.md §4): the ShardManifest type, reading it, and checking the files it
lists against the folder (validate and verify share these checks)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .formats import FORMAT, FORMATS, MARKS, StorageFormat, storage_format, storage_of_entry
from .layout import MANIFEST, TIMINGS, layer_file


@dataclass(slots=True)
class ShardManifest:
    """manifest.json: what the shard holds, what made it, and every data file's sha256 (written last)."""

    shard: int
    layer_ids: list[int]
    layer_id_convention: str
    num_hidden_layers: int
    hidden_size: int
    dtype: str  # the model's: what the capture computed in (the stored values' own dtype is stored_dtype)
    rows: int
    tokens: int
    row_range: list[int]
    tokenized: dict[str, str]  # path, sha256 of the tokenized shard it was captured from
    model: dict[str, Any]
    tokenizer: dict[str, Any]
    engine: dict[str, Any]  # backends.base.EngineInfo.manifest_entry()
    code_version: str
    files: dict[str, dict[str, Any]]  # name -> sha256, bytes (shape, dtype for tensors)
    format: str = FORMAT
    storage: dict[str, Any] | None = None  # StorageFormat.manifest_entry: None = hidden_states in `dtype`
    stored_dtype: str | None = None  # the layer files' values (uint8 for MXFP4); None in manifests before it

    def __post_init__(self) -> None:
        fmt = FORMATS.get(self.storage_name)  # an unknown one is refused by from_json
        if self.stored_dtype is None and fmt is not None:  # an older manifest: what its format stores
            self.stored_dtype = fmt.values_dtype(self.dtype)

    @property
    def storage_name(self) -> str:
        return storage_of_entry(self.storage)

    @property
    def storage_format(self) -> StorageFormat:
        """How the layer files store the states (shard/formats.py)."""
        return storage_format(self.storage_name)

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
        if data.get("format") not in MARKS:
            raise ValueError(f"{where}: format {data.get('format')!r}, expected one of {sorted(MARKS)}")
        try:
            m = cls(**data)
        except TypeError as e:  # a key missing or unknown: a damaged or foreign manifest
            raise ValueError(f"{where}: not a shard manifest ({e})") from None
        if m.storage_name not in (f.name for f in MARKS.values()) or MARKS[m.format].name != m.storage_name:
            raise ValueError(f"{where}: format {m.format!r} with storage {m.storage_name!r}")
        return m


def read_manifest(shard_dir: str | os.PathLike) -> ShardManifest:
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{shard_dir}: no {MANIFEST}, so the shard is not finished (rerun its extract job)")
    with open(path, encoding="utf-8") as f:
        return ShardManifest.from_json(json.load(f), str(path))


def check_listed_file(path: Path, entry: dict[str, Any]) -> tuple[bool, str]:
    """One file against its manifest entry ({"sha256", "bytes"}, as shard and export manifests list them):
    (ok, detail). Size first: a truncated file is named as such without reading it."""
    from ..infra.atomic import sha256_file

    if not path.is_file():
        return False, "listed in the manifest but missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return False, f"{size} bytes, manifest says {entry['bytes']} (truncated?)"
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        return False, f"sha256 {digest[:12]} != {entry['sha256'][:12]}"
    return True, "sha256 matches"


# Snakemake's marker in every directory() output: shard folders and the export both hold one.
SNAKEMAKE_MARKER = ".snakemake_timestamp"
# Files a finished shard folder may hold besides those its manifest lists.
SHARD_EXTRAS = frozenset({MANIFEST, TIMINGS, SNAKEMAKE_MARKER})
# Files the export folder may hold besides those its manifest lists.
EXPORT_EXTRAS = frozenset({MANIFEST, SNAKEMAKE_MARKER})


def stray_files(folder: Path, listed: set[str], extras: frozenset[str] = SHARD_EXTRAS) -> list[str]:
    """Files under `folder` (paths relative to it) that are neither listed nor expected extras."""
    on_disk = (str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    return sorted(name for name in on_disk if name not in listed and name not in extras)
