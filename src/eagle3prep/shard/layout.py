"""The shard folder's layout (DESIGN.md §4): file names and the safetensors header its files are written under.

A shard folder holds one `layer_{id}.safetensors` per layer id (tensor `hidden_states`, [sum_T, H]),
`token_ids.safetensors` (tensor `token_ids`, [sum_T] int64), `index.json` and, written last,
`manifest.json` (shard/manifest.py). A folder without a valid manifest is not finished.

Storage (`extract.storage`): each format (shard/formats.py, the one place its names and marks are imported
from) says which tensors a layer file holds: the values, then any scales, e.g. `fp8_e4m3`'s float8_e4m3fn
values and [sum_T, 1] float32 scales, `mxfp4`'s packed [sum_T, H / 2] uint8 values and [sum_T, H / 32] e8m0
scales. A scaled shard's manifest carries the format's mark and `storage` entry. Every reader goes through
shard/readers.py (LayerReader / read_layer), which decodes.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from ..infra.atomic import TMP_PREFIX
from ..infra.folder import MANIFEST, TIMINGS  # noqa: F401  (named here with the shard's other files)
from .formats import DTYPES

INDEX = "index.json"
TOKEN_IDS = "token_ids.safetensors"
LOGPROBS = "logprobs.safetensors"  # the engine's prompt logprobs of a few rows (validate's logits check)


def safetensors_header(
    tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file holding `tensors` back to back, with
    `metadata` (strings) as its `__metadata__`."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
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
