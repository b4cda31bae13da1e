"""Readers of shard folders and of the tokenized shards they are captured from (DESIGN.md §4).

Every reader of a layer file goes through LayerReader / read_layer, which decode scaled files (FP8, MXFP4),
so no caller depends on how a layer is stored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..records import IndexEntry
from .formats import SCALES_KEY, VALUES_KEY, StorageFormat, format_of_file
from .layout import INDEX, LOGPROBS, TOKEN_IDS
from .tokenized import rows as tokenized_rows

if TYPE_CHECKING:
    import torch

IMAGE_BACKENDS = ("hf", "vllm")  # extract backends that capture rows with images (tokenize/row_inputs.py)


def read_index(shard_dir: str | os.PathLike) -> list[IndexEntry]:
    """A shard folder's index.json: where each row sits in its layer files."""
    with open(Path(shard_dir) / INDEX, encoding="utf-8") as f:
        return [IndexEntry(**e) for e in json.load(f)]


def index_of_tokenized(tokenized_shard: str | os.PathLike, backend: str | None = None) -> list[IndexEntry]:
    """Where each row of a tokenized shard will sit in the layer files (offsets by seq_len). A row with images
    is refused unless `backend` is one that feeds them to the vision encoder (IMAGE_BACKENDS)."""
    index, offset = [], 0
    for rec in tokenized_rows(tokenized_shard):
        if "images" in rec and backend not in IMAGE_BACKENDS:  # input_ids alone embed image tokens as text
            raise UserError(
                f"{tokenized_shard}: row {rec['row']} has images; extract.backend {backend} does not feed images "
                f"to the vision encoder yet: use extract.backend {' or '.join(IMAGE_BACKENDS)}"
                ", or list text-only sources in data.sources"
            )
        index.append(IndexEntry(row=rec["row"], id=rec["id"], offset=offset, length=rec["seq_len"]))
        offset += rec["seq_len"]
    return index


class LayerReader:
    """One layer file open for reading rows (memory-mapped); scaled files are decoded on read.

    The file says how it is stored (its metadata, or for files written before it had any, its tensors:
    formats.format_of_file), so any layer file reads the same way:
    `rows(a, b)` is [b - a, H]; `dtype` None gives a model-dtype file as stored and a scaled one as bfloat16
    (what trainers read); validation asks for float32.
    """

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        self._f = safe_open(str(path), framework="pt")
        self.values = self._f.get_slice(VALUES_KEY)
        self.scales = self._f.get_slice(SCALES_KEY) if SCALES_KEY in self._f.keys() else None  # noqa: SIM118
        self.metadata: dict[str, str] = self._f.metadata() or {}  # files written before it carried none
        try:
            self.format: StorageFormat = format_of_file(self.tensors(), self.metadata)
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None

    @property
    def shape(self) -> list[int]:
        """[T, H]: the rows and the hidden size they decode to (an MXFP4 file stores H / 2 bytes a row)."""
        rows, width = self.values.get_shape()
        return [rows, width * self.format.packing]

    def tensors(self) -> dict[str, tuple[str, list[int]]]:
        """name -> (safetensors dtype code, shape) of every tensor the file holds (validation's layout check)."""
        return {n: (self._f.get_slice(n).get_dtype(), self._f.get_slice(n).get_shape()) for n in self._f.keys()}  # noqa: SIM118

    def rows(self, a: int, b: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        parts = (self.values[a:b],) if self.scales is None else (self.values[a:b], self.scales[a:b])
        return self.format.decode(parts, dtype)


def read_token_ids(shard_dir: str | os.PathLike) -> torch.Tensor:
    """A shard folder's token ids, [sum_T] int64."""
    from safetensors import safe_open

    with safe_open(str(Path(shard_dir) / TOKEN_IDS), framework="pt") as f:
        return f.get_tensor("token_ids")


def read_logprobs(shard_dir: str | os.PathLike) -> tuple[list[int], list[torch.Tensor]]:
    """The engine's prompt logprobs a shard stores (logprobs.safetensors): the rows' positions in the shard,
    and each row's logprobs."""
    from safetensors import safe_open

    with safe_open(str(Path(shard_dir) / LOGPROBS), framework="pt") as f:
        rows, offsets, stored = f.get_tensor("rows").tolist(), f.get_tensor("offsets"), f.get_tensor("logprobs")
    return rows, [stored[offsets[k] : offsets[k + 1]] for k in range(len(rows))]


def read_layer(path: str | os.PathLike, a: int = 0, b: int | None = None, dtype: torch.dtype | None = None):
    """Rows a..b-1 of a layer file ([b - a, H]; all rows when b is None), dequantized (LayerReader.rows)."""
    reader = LayerReader(path)
    return reader.rows(a, reader.shape[0] if b is None else b, dtype)
