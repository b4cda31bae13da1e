"""The regenerated shards joined into the files tokenize reads (results/regenerated/): conversations.jsonl and
quarantine.jsonl in shard order, and counts.json, which must add up to what prepare kept."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from eagle3prep.errors import UserError
from eagle3prep.infra.atomic import atomic_open, write_json
from eagle3prep.infra.folder import MANIFEST
from eagle3prep.regenerate.counts import merged_counts, summarize
from eagle3prep.regenerate.stage import CONVERSATIONS, COUNTS, QUARANTINE

from ..infra.log import get_logger

log = get_logger("regenerate")


class ShardError(UserError):
    """A regenerated shard that is unfinished or whose files differ from its manifest."""


def _copy_checked(src: Path, dst, sha256: str) -> int:
    """Append `src` to the open file `dst`; return its line count. Raise ShardError unless its bytes hash to
    `sha256` (the shard's manifest): a file changed after its shard finished is not merged in silence."""
    h, lines = hashlib.sha256(), 0
    with open(src, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            lines += block.count(b"\n")
            dst.write(block)
    if h.hexdigest() != sha256:
        raise ShardError(
            f"{src}: its bytes differ from its shard's {MANIFEST} (sha256 {h.hexdigest()[:12]} != {sha256[:12]}); "
            f"delete {src.parent} and run the same command again to regenerate it"
        )
    return lines


def merge_shards(
    shard_dirs: list[str | os.PathLike],
    prepared_counts_path: str | os.PathLike,
    out_conversations: str | os.PathLike,
    out_quarantine: str | os.PathLike,
    out_counts: str | os.PathLike,
) -> dict[str, Any]:
    """Join the shards (each checked against its manifest) and write the merged counts; return them."""
    manifests, shard_counts = [], []
    for d in map(Path, shard_dirs):
        if not (d / MANIFEST).is_file():
            raise ShardError(f"{d} has no {MANIFEST} (a run stopped while writing it); run the same command again")
        manifests.append(json.loads((d / MANIFEST).read_text(encoding="utf-8")))
        shard_counts.append(json.loads((d / COUNTS).read_text(encoding="utf-8")))
    _check_same_settings(shard_dirs, manifests)
    written = {"conversations": 0, "quarantine": 0}
    with (
        atomic_open(out_conversations, "wb") as conv_f,
        atomic_open(out_quarantine, "wb") as quar_f,
    ):
        for d, manifest in zip(map(Path, shard_dirs), manifests, strict=True):
            files = manifest["files"]
            written["conversations"] += _copy_checked(d / CONVERSATIONS, conv_f, files[CONVERSATIONS]["sha256"])
            written["quarantine"] += _copy_checked(d / QUARANTINE, quar_f, files[QUARANTINE]["sha256"])
        prepared = json.loads(Path(prepared_counts_path).read_text(encoding="utf-8"))
        counts = merged_counts(shard_counts, prepared, written)
    counts["shard_manifests"] = {
        str(d): hashlib.sha256((Path(d) / MANIFEST).read_bytes()).hexdigest() for d in shard_dirs
    }
    write_json(out_counts, counts)
    log.info(summarize(counts))
    return counts


# What every shard of one dataset must share: a merge of shards made with other settings would mix two datasets.
SAME_IN_EVERY_SHARD = ("model", "tokenizer", "chat_template_kwargs", "sampling", "policy", "thinking")
# A manifest written before a key existed: what the shard was made with.
BEFORE_THE_KEY = {"chat_template_kwargs": {}}


def _check_same_settings(shard_dirs: list, manifests: list[dict[str, Any]]) -> None:
    for d, m in zip(shard_dirs[1:], manifests[1:], strict=True):
        for key in SAME_IN_EVERY_SHARD:
            mine, first = (x.get(key, BEFORE_THE_KEY.get(key)) for x in (m, manifests[0]))
            if mine != first:
                raise ShardError(
                    f"{d} was regenerated with another {key} than {shard_dirs[0]} ({mine} != {first}); "
                    "run with -R regenerate to regenerate every shard with one setting"
                )
