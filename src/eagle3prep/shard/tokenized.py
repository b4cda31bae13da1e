"""The one reader of the tokenized shards (`results/tokenized/shard_{k}.jsonl`, DESIGN.md §3): one JSON row a
line. Every stage that reads them (extract, validate, export, the dataset, the report, the gate) goes through
here, so a change of the format is made in one place (tests/test_tokenized_reader.py keeps it so)."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from typing import Any


def parse_row(line: bytes | str) -> dict[str, Any]:
    """One line of a tokenized shard as its row."""
    return json.loads(line)


def rows_with_lines(path: str | os.PathLike) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """(the line's bytes, its row) for every row in order: for who hashes the file or keeps rows' positions."""
    with open(path, "rb") as f:
        for line in f:
            yield line, parse_row(line)


def rows(path: str | os.PathLike, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """The rows of a tokenized shard in order (only the first `limit` lines read when given)."""
    with open(path, "rb") as f:
        for line in itertools.islice(f, limit):
            yield parse_row(line)


def row_at(path: str | os.PathLike, pos: int) -> dict[str, Any]:
    """The row whose line starts at byte `pos` (a position rows_with_lines' lines give)."""
    with open(path, "rb") as f:
        f.seek(pos)
        return parse_row(f.readline())
