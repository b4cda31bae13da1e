"""Hidden-state shards: the format (format.py), the files (files.py), the layer sink every backend
writes through (sink.py), the shard writer (writer.py) and the checked set of shards (shardset.py)."""

from .format import (
    DTYPES,
    FORMAT,
    INDEX,
    MANIFEST,
    TIMINGS,
    TOKEN_IDS,
    DiskSpaceError,
    EngineInfo,
    ShardManifest,
    human_bytes,
    index_of_tokenized,
    layer_file,
    read_index,
    read_manifest,
)

__all__ = [
    "DTYPES",
    "FORMAT",
    "INDEX",
    "MANIFEST",
    "TIMINGS",
    "TOKEN_IDS",
    "DiskSpaceError",
    "EngineInfo",
    "ShardManifest",
    "human_bytes",
    "index_of_tokenized",
    "layer_file",
    "read_index",
    "read_manifest",
]
