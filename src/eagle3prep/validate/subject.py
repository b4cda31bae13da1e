"""The shard under validation: opened once, read by every family of checks through the same readers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..shard.layout import FP8_E4M3, layer_file
from ..shard.readers import LayerReader

if TYPE_CHECKING:
    import torch

    from ..shard.manifest import ShardManifest
    from ..shard.shardset import Shard


class ShardUnderTest:
    """A shard opened with its tokenized records (parsed once, shardset.read_tokenized) and one LayerReader
    per layer file, opened on first use and shared by the content, reference and scalable checks."""

    def __init__(self, shard: Shard):
        if shard.records is None:
            raise ValueError(
                f"{shard.dir}: opened without its tokenized records (open_shard with read_tokenized(..., records=True))"
            )
        self.shard = shard
        self._readers: dict[int, LayerReader] = {}

    @property
    def dir(self) -> Path:
        return self.shard.dir

    @property
    def manifest(self) -> ShardManifest:
        return self.shard.manifest

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The tokenized shard's records, in row order (input_ids, images)."""
        return self.shard.records or []

    @property
    def fp8(self) -> bool:
        return self.manifest.storage_name == FP8_E4M3

    def layer(self, lid: int) -> LayerReader:
        if lid not in self._readers:
            self._readers[lid] = LayerReader(self.dir / layer_file(lid))
        return self._readers[lid]

    def states(self, lid: int, picks: list[int], dtype: torch.dtype | None) -> list[torch.Tensor]:
        """Layer id `lid`'s [T, H] states of the rows at positions `picks` of the shard (FP8 dequantized)."""
        index, reader = self.shard.index, self.layer(lid)
        return [reader.rows(index[i].offset, index[i].offset + index[i].length, dtype) for i in picks]
