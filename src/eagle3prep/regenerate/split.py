"""The prepared conversations cut into regenerate.num_shards contiguous prompt shards (one GPU job each), and
split.json: where each shard starts in the prepared file, so quarantine records name the prepared line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagle3prep.infra.atomic import atomic_open, sha256_file, write_json
from eagle3prep.tokenize.stage import copy_lines, shard_ranges

SPLIT_JSON = "split.json"


def split_conversations(conversations_path: str | os.PathLike, out_shards: list[str | os.PathLike]) -> dict[str, Any]:
    """Write shard k's lines to out_shards[k] (contiguous ranges, sizes within one; maybe empty), then split.json
    next to them; return its content."""
    if not out_shards:
        raise ValueError("out_shards is empty; regenerate.num_shards must be at least 1")
    with open(conversations_path, "rb") as f:
        rows = sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))
    shards = []
    with open(conversations_path, "rb") as src:
        for k, (start, end) in enumerate(shard_ranges(rows, len(out_shards))):
            with atomic_open(out_shards[k], "wb") as dst:
                copy_lines(src, dst, end - start)
            shards.append({"shard": k, "path": str(out_shards[k]), "first_line": start + 1, "rows": end - start})
    split = {
        "source": str(conversations_path),
        "source_sha256": sha256_file(conversations_path),
        "rows": rows,
        "shards": shards,
    }
    write_json(Path(out_shards[0]).parent / SPLIT_JSON, split)
    return split


def shard_entry(prompts_shard: str | os.PathLike) -> dict[str, Any]:
    """split.json's entry of one prompt shard (split.json sits in the shard's folder)."""
    split = json.loads((Path(prompts_shard).parent / SPLIT_JSON).read_text(encoding="utf-8"))
    name = Path(prompts_shard).name
    for entry in split["shards"]:
        if Path(entry["path"]).name == name:
            return {**entry, "source": split["source"]}
    raise ValueError(
        f"{prompts_shard} is not listed in its folder's {SPLIT_JSON}; run the regenerate_split rule again"
    )
