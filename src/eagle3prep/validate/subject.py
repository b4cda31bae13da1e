"""The shard under validation: opened once, read by every family of checks through the same readers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..shard.layout import layer_file
from ..shard.readers import LayerReader

if TYPE_CHECKING:
    import torch

    from ..shard.formats import StorageFormat
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
    def scaled(self) -> StorageFormat | None:
        """The shard's scaled storage format (FP8, MXFP4), None when it keeps the model dtype."""
        fmt = self.manifest.storage_format
        return fmt if fmt.scaled else None

    def layer(self, lid: int) -> LayerReader:
        if lid not in self._readers:
            self._readers[lid] = LayerReader(self.dir / layer_file(lid))
        return self._readers[lid]

    def states(self, lid: int, picks: list[int], dtype: torch.dtype | None) -> list[torch.Tensor]:
        """Layer id `lid`'s [T, H] states of the rows at positions `picks` of the shard (decoded from a scaled storage)."""
        index, reader = self.shard.index, self.layer(lid)
        return [reader.rows(index[i].offset, index[i].offset + index[i].length, dtype) for i in picks]
