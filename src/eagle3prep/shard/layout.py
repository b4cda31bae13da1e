"""The shard folder's layout (DESIGN.md §4): file names, format marks, the dtype table, each layer file's
tensors and the safetensors header they are written under.

A shard folder holds one `layer_{id}.safetensors` per layer id (tensor `hidden_states`, [sum_T, H]),
`token_ids.safetensors` (tensor `token_ids`, [sum_T] int64), `index.json` and, written last,
`manifest.json` (shard/manifest.py). A folder without a valid manifest is not finished.

Storage (`extract.storage`): `model_dtype` keeps `hidden_states` in the capture dtype; `fp8_e4m3`
stores it as float8_e4m3fn followed by `hidden_states_scales` [sum_T, 1] float32, one scale per token
(shard/fp8.py), and marks the manifest with FORMAT_FP8 and its `storage` entry. Every reader goes
through shard/readers.py (LayerReader / read_layer), which dequantize.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from ..infra.atomic import TMP_PREFIX
from ..infra.folder import MANIFEST, TIMINGS  # noqa: F401  (named here with the shard's other files)
from .fp8 import FP8_DTYPE, FP8_MAX, SCALE_MIN, SCALES_KEY

INDEX = "index.json"
TOKEN_IDS = "token_ids.safetensors"
LOGPROBS = "logprobs.safetensors"  # the engine's prompt logprobs of a few rows (validate's logits check)
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
