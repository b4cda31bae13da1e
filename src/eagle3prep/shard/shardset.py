"""Shard folders opened with the tokenized shards they were captured from, checked once (DESIGN.md §4).

Validate, the report, the export and HiddenStatesDataset all start here, so "do these files agree"
has one answer: same dtype, storage, layer ids, H and N; each index matches its tokenized rows and the
tokenized file's sha256 recorded at capture time; rows contiguous across shards; last id = N.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..check import Check
from ..errors import UserError
from ..layers import CONVENTION, to_convention
from ..records import IndexEntry
from .manifest import ShardManifest, read_manifest
from .readers import read_index
from .tokenized import rows_with_lines as tokenized_rows_with_lines


def speculators_layer_error(ids: list[int], n: int, convention: str = CONVENTION) -> str | None:
    """Why layer ids `ids` (our convention, model depth `n`) cannot feed speculators, or None: the last slot
    must be the pre-norm final state N after at least one auxiliary layer. Checked at parse time too, where
    the message shows the ids in `convention`, the one layers.ids is written in."""
    if ids[-1] != n or len(ids) < 2:
        shown, final = to_convention(ids, convention), to_convention([n], convention)[0]
        named = "" if convention == CONVENTION else f" ({convention})"
        return (
            f"layer ids {shown}{named} cannot feed speculators: its last slot must be the pre-norm final state "
            f"(id {final}) after at least one auxiliary layer; add {final} to layers.ids and rerun extract"
        )
    return None


class ShardSetError(UserError, ValueError):
    """The shards and their tokenized files do not agree; the message names the file and the fix."""


@dataclass(slots=True)
class TokenizedRef:
    """One tokenized row as the checks need it: its identity and where its line starts."""

    row: int
    id: str
    seq_len: int
    byte_offset: int


@dataclass(slots=True)
class Shard:
    dir: Path
    manifest: ShardManifest
    index: list[IndexEntry]
    tokenized: Path
    tokenized_rows: list[TokenizedRef]
    tokenized_sha256: str
    records: list[dict[str, Any]] | None = None  # the tokenized rows themselves, when opened with them


@dataclass(slots=True)
class Tokenized:
    """A tokenized shard read once: its rows' identities, its sha256 and, when asked, the records themselves
    (validation needs their input_ids and images; the export and the dataset do not hold them)."""

    path: Path
    refs: list[TokenizedRef]
    sha256: str
    records: list[dict[str, Any]] | None = None


def read_tokenized(path: str | os.PathLike, records: bool = False) -> Tokenized:
    """The rows' identities and the file's sha256 (and the parsed records), in one pass over its bytes."""
    refs, kept, digest, pos = [], [], hashlib.sha256(), 0
    for line, rec in tokenized_rows_with_lines(path):
        digest.update(line)
        refs.append(TokenizedRef(rec["row"], rec["id"], rec["seq_len"], pos))
        if records:
            kept.append(rec)
        pos += len(line)
    return Tokenized(Path(path), refs, digest.hexdigest(), kept if records else None)


def open_shard(
    shard_dir: str | os.PathLike, tokenized: str | os.PathLike | Tokenized, manifest: ShardManifest | None = None
) -> Shard:
    """A shard folder with its tokenized shard (a path, or one already read) and manifest (read when None)."""
    tok = tokenized if isinstance(tokenized, Tokenized) else read_tokenized(tokenized)
    manifest = manifest or read_manifest(shard_dir)
    return Shard(Path(shard_dir), manifest, read_index(shard_dir), tok.path, tok.refs, tok.sha256, tok.records)


def shard_checks(s: Shard) -> list[Check]:
    """One shard against its tokenized file: row count, row identities, offsets, and the source sha256."""
    m, index, rows = s.manifest, s.index, s.tokenized_rows
    out = [Check("row_count", len(index) == len(rows), f"index {len(index)} rows, tokenized shard {len(rows)}")]
    bad = [e.row for e, r in zip(index, rows, strict=False) if (e.row, e.id, e.length) != (r.row, r.id, r.seq_len)]
    out.append(Check("index_rows", not bad, f"rows whose row/id/length differ from the tokenized shard: {bad[:10]}"))
    offset, gaps = 0, []
    for e in index:
        if e.offset != offset:
            gaps.append(e.row)
        offset = e.offset + e.length
    out.append(
        Check(
            "index_offsets",
            not gaps and offset == m.tokens,
            f"non-contiguous at rows {gaps[:10]}; ends at {offset}, manifest tokens {m.tokens}",
        )
    )
    same = s.tokenized_sha256 == m.tokenized["sha256"]
    out.insert(
        0,
        Check(
            "tokenized_source",
            same,
            "the shard was captured from this tokenized shard"
            if same
            else f"{s.tokenized} is not the tokenized shard {s.dir} was captured from (sha256 differs)",
        ),
    )
    return out


class ShardSet:
    """Shards in row order with their tokenized files; `check()` raises ShardSetError on disagreement."""

    def __init__(self, shards: list[Shard]):
        if not shards:
            raise ShardSetError("no shard folders given")
        self.shards = shards

    @classmethod
    def open(cls, shard_dirs: list[str | os.PathLike], tokenized: list[str | os.PathLike]) -> ShardSet:
        if len(shard_dirs) != len(tokenized):
            raise ShardSetError(
                f"need one tokenized shard per shard folder, got {len(tokenized)} for {len(shard_dirs)}"
            )
        return cls([open_shard(d, t) for d, t in zip(shard_dirs, tokenized, strict=True)])

    @property
    def first(self) -> ShardManifest:
        return self.shards[0].manifest

    @property
    def layer_ids(self) -> list[int]:
        return self.first.layer_ids

    def check(self, *, final_layer: bool = True) -> ShardSet:
        """Every shard matches its tokenized file, all agree, rows run 0..n-1 without gaps, and
        (final_layer) the last id is N after at least one auxiliary layer, as speculators reads them."""
        for s in self.shards:
            failed = [c for c in shard_checks(s) if not c.ok]
            if failed:
                raise ShardSetError(f"{s.dir}: {failed[0].name}: {failed[0].detail}")
        kinds = {
            (m.dtype, m.storage_name, tuple(m.layer_ids), m.hidden_size, m.num_hidden_layers)
            for m in (s.manifest for s in self.shards)
        }
        if len(kinds) != 1:  # storage too: one export holds one format
            raise ShardSetError(
                f"shards disagree on (dtype, storage, layer ids, hidden size, N): {sorted(kinds)}; rerun the odd ones"
            )
        n, ids = self.first.num_hidden_layers, self.layer_ids
        if final_layer and (error := speculators_layer_error(ids, n)):
            raise ShardSetError(error)
        expected = 0
        for s in self.shards:
            m = s.manifest
            a, b = m.row_range
            if m.rows == 0:  # more shards than rows: an empty shard's range is [0, 0]
                continue
            if a != expected or b - a != m.rows or s.index[0].row != a:
                raise ShardSetError(
                    f"{s.dir} holds rows {a}..{b - 1} ({m.rows} rows), expected rows from {expected} (shards out "
                    "of order?): speculators names hidden-state files by row index, so shards must be given in "
                    "order, without gaps"
                )
            expected = b
        return self
