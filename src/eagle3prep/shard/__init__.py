"""Hidden-state shards: the format (format.py), the files (files.py), the layer sink every backend
writes through (sink.py), the shard writer (writer.py), the checked set of shards (shardset.py) and
FP8 storage's quantization (fp8.py). Read layer rows with read_layer / LayerReader: they dequantize."""

from .format import (
    DTYPES,
    FORMAT,
    FORMAT_FP8,
    INDEX,
    MANIFEST,
    STORAGES,
    TIMINGS,
    TOKEN_IDS,
    DiskSpaceError,
    EngineInfo,
    LayerReader,
    ShardManifest,
    human_bytes,
    index_of_tokenized,
    layer_file,
    read_index,
    read_layer,
    read_manifest,
)

__all__ = [
    "DTYPES",
    "FORMAT",
    "FORMAT_FP8",
    "INDEX",
    "MANIFEST",
    "STORAGES",
    "TIMINGS",
    "TOKEN_IDS",
    "DiskSpaceError",
    "EngineInfo",
    "LayerReader",
    "ShardManifest",
    "human_bytes",
    "index_of_tokenized",
    "layer_file",
    "read_index",
    "read_layer",
    "read_manifest",
]
