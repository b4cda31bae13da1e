"""Hidden-state shards: the folder's layout (layout.py), its manifest (manifest.py), the readers
(readers.py), the files (files.py), the layer sink every backend writes through (sink.py), the shard
writer (writer.py), the checked set of shards (shardset.py) and the storage formats (formats.py, with
fp8.py and mxfp4.py: their names, marks and dtypes are imported from formats.py alone); the
one reader of the tokenized shards they are captured from (tokenized.py).
Read layer rows with read_layer / LayerReader: they decode."""

from .layout import INDEX, MANIFEST, TIMINGS, TOKEN_IDS, layer_file
from .manifest import ShardManifest, read_manifest
from .readers import LayerReader, index_of_tokenized, read_index, read_layer

__all__ = [
    "INDEX",
    "MANIFEST",
    "TIMINGS",
    "TOKEN_IDS",
    "LayerReader",
    "ShardManifest",
    "index_of_tokenized",
    "layer_file",
    "read_index",
    "read_layer",
    "read_manifest",
]
