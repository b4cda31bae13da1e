"""Rows of the export's shard folders, read straight from the layer files (no hs_{row} copy).

`ExportRows.from_export(data_path)` reads the export's manifest.json (`sources`: each shard folder,
its row range and its manifest's sha256) and `ExportRows.get(row)` returns what speculators'
FileTransfer returns for hs_{row}.safetensors of a copy export, equal tensor for tensor:

    token_ids      [T]        int64
    hidden_states  [T, L, H]  layer ids ascending, the last slot id N (before the final norm)

Each layer's rows are read through shard.readers.LayerReader (a memory-mapped `get_slice` of its
`[sum_T, H]` file, so only the row's bytes are read). FP8 layer files (extract.storage fp8_e4m3) are
dequantized to bf16 with their per-token, per-layer scales by speculators' own function, as its `fp8`
backend dequantizes an FP8 hs file: the direct way then equals a copy of the same FP8 bytes read by
`--hidden-states-backend fp8`, tensor for tensor (tests/test_train.py). Shards are opened lazily, per process (speculators' DataLoader workers are spawned and get this
object pickled without its handles), and at most `MAX_OPEN` at a time, so 10,000 shards do not hold
50,000 file handles. A shard whose manifest changed since the export (re-extracted, healed) is refused:
the arrow part (input_ids, loss_mask) was written from the old one.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..shard.layout import INDEX, MANIFEST, TOKEN_IDS, layer_file
from ..shard.readers import LayerReader

EXPORT_FORMAT = "eagle3prep.speculators_export/1"  # export.FORMAT (not imported: export pulls in datasets)
MAX_OPEN = 16


class ExportRowsError(UserError, ValueError):
    """The export and the shard folders it names do not agree; the message says what to rerun."""


@dataclass(slots=True)
class Source:
    dir: Path
    row_range: tuple[int, int]
    manifest_sha256: str


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _OpenShard:
    """One shard's index offsets and open safetensors handles (per process, never pickled): the files of the
    layers in `view` only, stacked in its order."""

    def __init__(self, src: Source, layer_ids: list[int], view: list[int]):
        from safetensors import safe_open

        raw = (src.dir / MANIFEST).read_bytes()  # checked again here: a shard may be redone during training
        if hashlib.sha256(raw).hexdigest() != src.manifest_sha256:
            raise ExportRowsError(
                f"{src.dir / MANIFEST} changed since the export was written (the shard was extracted again): "
                "its input_ids and loss masks may differ; rerun the export (snakemake -R export)"
            )
        manifest = json.loads(raw)
        if manifest["layer_ids"] != layer_ids:
            raise ExportRowsError(f"{src.dir}: layer ids {manifest['layer_ids']}, the export has {layer_ids}")
        index = json.loads((src.dir / INDEX).read_text(encoding="utf-8"))
        first = src.row_range[0]
        if [e["row"] for e in index] != list(range(first, src.row_range[1])):
            raise ExportRowsError(f"{src.dir / INDEX} does not hold rows {first}..{src.row_range[1] - 1}")
        self.first = first
        self.spans = [(e["offset"], e["offset"] + e["length"]) for e in index]
        self.layers = [LayerReader(src.dir / layer_file(i)) for i in view]
        self._token_file = safe_open(src.dir / TOKEN_IDS, framework="pt")
        self.tokens = self._token_file.get_slice("token_ids")

    def row(self, row: int) -> dict[str, torch.Tensor]:
        a, b = self.spans[row - self.first]
        hidden = torch.stack([layer_rows(r, a, b) for r in self.layers], dim=1)  # [T, L, H]
        return {"token_ids": self.tokens[a:b], "hidden_states": hidden}


def layer_rows(reader: LayerReader, a: int, b: int) -> torch.Tensor:
    """Rows a..b-1 of one layer, [b - a, H], as speculators' trainer gets them from an hs file."""
    if not reader.format.exports_scales:
        return reader.rows(a, b)  # the stored dtype, as FileTransfer returns it
    # hs_connectors' FP8Transfer math (fp8.to(bf16) * scale.to(bf16)); LayerReader's float32 product can
    # round the last bf16 bit the other way, and the two ways would then train on different numbers.
    from hs_connectors.fp8_utils import dequantize_fp8_tensor

    return dequantize_fp8_tensor(reader.values[a:b], reader.scales[a:b], dtype=torch.bfloat16)


class ExportRows:
    """Global row id -> that row's token ids and stacked hidden states, from the shard folders.

    `view`: the layer ids a row's `hidden_states` holds, in slot order (default every captured layer, ascending):
    one draft's layers (drafts.Draft.reads: its --target-layer-ids, then N), read from their files alone."""

    def __init__(self, sources: list[Source], layer_ids: list[int], view: list[int] | None = None):
        self.sources = [s for s in sources if s.row_range[1] > s.row_range[0]]  # empty shards hold no row
        self.layer_ids = layer_ids
        self.view = list(layer_ids) if view is None else list(view)
        if lacking := [i for i in self.view if i not in layer_ids]:
            raise ExportRowsError(
                f"layer ids {lacking} of the view {self.view} were not captured: the dataset holds {layer_ids} "
                "(ours = speculators' --target-layer-ids numbering); name the draft in layers.drafts and capture again"
            )
        self._starts = [s.row_range[0] for s in self.sources]
        self._open: OrderedDict[int, _OpenShard] = OrderedDict()

    def with_view(self, view: list[int]) -> ExportRows:
        """The same rows with `hidden_states` holding the layers `view`, in that order (no byte copied)."""
        return ExportRows(self.sources, self.layer_ids, view)

    @classmethod
    def from_export(cls, data_path: str | os.PathLike, shards_dir: str | os.PathLike | None = None) -> ExportRows:
        """The rows behind `data_path` (an export of any `hidden_states` mode). Each shard folder is looked
        for in `shards_dir` when given (results/hidden_states moved), else where the manifest recorded it
        (absolute, or relative to the working folder: training started in the workflow's folder), else in
        the workflow's layout beside the export (results/export/speculators -> results/hidden_states)."""
        root = Path(data_path)
        path = root / MANIFEST
        if not path.is_file():
            raise ExportRowsError(
                f"{path} is missing: --data-path must be an eagle3prep export (export.speculators: true), "
                "finished (its manifest is written last)"
            )
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if manifest.get("format") != EXPORT_FORMAT or "row_range" not in manifest["sources"][0]:
            raise ExportRowsError(
                f"{path}: format {manifest.get('format')!r} without shard row ranges; rerun the export with "
                "this version of eagle3prep"
            )
        sources = []
        for s in manifest["sources"]:
            name = Path(s["shard_dir"]).name
            tried = (
                [Path(shards_dir) / name]
                if shards_dir
                else [Path(s["shard_dir"]), root / "../../hidden_states" / name]
            )
            found = [d for d in tried if (d / MANIFEST).is_file()]
            # A relative path may name another run's shard from this working folder: take the one captured.
            same = [d for d in found if _sha256(d / MANIFEST) == s["manifest_sha256"]]
            if not found:
                raise ExportRowsError(
                    f"shard folder {name} (rows from {s['row_range'][0]}) is in none of {[str(d) for d in tried]}; "
                    "the export reads its rows from there (pass --eagle3prep-shards DIR, the folder holding it)"
                )
            sources.append(Source((same or found)[0], tuple(s["row_range"]), s["manifest_sha256"]))
        return cls(sources, manifest["layer_ids"])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": OrderedDict()}  # each process opens its own handles

    def _shard(self, k: int) -> _OpenShard:
        if k in self._open:
            self._open.move_to_end(k)
        else:
            self._open[k] = _OpenShard(self.sources[k], self.layer_ids, self.view)
            if len(self._open) > MAX_OPEN:
                self._open.popitem(last=False)  # closes its memory maps once no tensor refers to them
        return self._open[k]

    def __contains__(self, row: int) -> bool:
        k = bisect.bisect_right(self._starts, row) - 1
        return k >= 0 and row < self.sources[k].row_range[1]

    def get(self, row: int) -> dict[str, torch.Tensor] | None:
        """Row `row` as {"token_ids", "hidden_states"}; None for a row no shard holds (as a missing hs file)."""
        if row not in self:
            return None
        return self._shard(bisect.bisect_right(self._starts, row) - 1).row(row)
