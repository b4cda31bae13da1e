"""A training Dataset over our shard folders: speculators' per-row items, without the export copy.

`HiddenStatesDataset[i]` returns exactly what speculators 0.9's `ArrowDataset[i]`
(speculators/train/data.py) returns for arrow row i of our export, same keys, shapes and dtypes:

    hidden_states                [T, (L-1)*H]  model dtype: the auxiliary layers, ascending ids, side by side
    input_ids                    [T]           int64
    verifier_last_hidden_states  [T, H]        model dtype: the last layer id (N, before the final norm)
    (FP8 shards, extract.storage fp8_e4m3: both dequantized to bf16 on read, as speculators' fp8 backend
    hands its items over)
    loss_mask                    [T]           int64
    lengths                      [1]           int64 (= T)
    position_ids                 [T]           int64 (0..T-1)

Hidden states are read through shard.readers.LayerReader (safetensors' memory-mapped `get_slice`): only
the row's bytes are copied.
Loss masks come from the tokenized shard each hidden-state shard was captured from (its manifest holds
that file's sha256, checked here). Like ArrowDataset, it exposes `approx_lengths` and
`hidden_states_dtype`, which speculators' batch sampler and collate function read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from ..shard.layout import TOKEN_IDS, layer_file
from ..shard.readers import LayerReader
from ..shard.shardset import ShardSet
from ..shard.tokenized import row_at as tokenized_row_at


class HiddenStatesDataset(Dataset):
    """Rows of `results/hidden_states/shard_*` in global row order.

    Args:
        shard_dirs: finished shard folders, in row order (shard_0, shard_1, ...).
        tokenized: the tokenized shard (JSONL) of each shard folder, same order.
        train_ratio, split: speculators' split: "train" is the first int(n * train_ratio) rows, "val" the rest.
        hidden_states_dtype: what speculators' CollateFn casts hidden states to (items keep the stored dtype).
    """

    def __init__(
        self,
        shard_dirs: list[str | os.PathLike],
        tokenized: list[str | os.PathLike],
        train_ratio: float = 1.0,
        split: Literal["train", "val"] = "train",
        hidden_states_dtype: torch.dtype = torch.bfloat16,
    ):
        shards = ShardSet.open(shard_dirs, tokenized).check(final_layer=True)  # ShardSetError is a ValueError
        self.shard_dirs = [s.dir for s in shards.shards]
        self.hidden_states_dtype = hidden_states_dtype
        self.layer_ids: list[int] = shards.layer_ids
        # Per row: (shard number, offset into the layer files, length, byte offset of its tokenized line).
        self._rows: list[tuple[int, int, int, int]] = []
        self._tokenized = [s.tokenized for s in shards.shards]
        for k, s in enumerate(shards.shards):
            for e, ref in zip(s.index, s.tokenized_rows, strict=True):
                self._rows.append((k, e.offset, e.length, ref.byte_offset))

        if not 0.0 < train_ratio <= 1.0:
            raise ValueError(f"train_ratio must be in (0.0, 1.0], got {train_ratio}")
        cut = int(len(self._rows) * train_ratio)
        self._rows = self._rows[:cut] if split == "train" else self._rows[cut:]
        self.approx_lengths = [length for _, _, length, _ in self._rows]
        self._open: dict[int, Any] = {}  # shard number -> open safetensors handles (per process)

    @classmethod
    def from_results(cls, results_dir: str | os.PathLike = "results", **kwargs: Any) -> HiddenStatesDataset:
        """Every shard of the dataset under results_dir/hidden_states (those results_dir/tokenized/stats.json lists,
        as verify checks them: a folder left by a config with more shards is not read), with
        results_dir/tokenized/shard_{k}.jsonl."""
        from ..verify import dataset_shards

        root = Path(results_dir)
        listed = dataset_shards(root)
        if listed is not None:
            shards = [root / "hidden_states" / f"shard_{k}" for k in listed]
        else:
            found = [p for p in (root / "hidden_states").glob("shard_*") if p.name.removeprefix("shard_").isdigit()]
            shards = sorted(found, key=lambda p: int(p.name.removeprefix("shard_")))
        if not shards:
            raise FileNotFoundError(f"no shard folders under {root / 'hidden_states'}; run the workflow first")
        tokenized = [root / "tokenized" / f"{d.name}.jsonl" for d in shards]
        return cls(shards, tokenized, **kwargs)

    def __len__(self) -> int:
        return len(self._rows)

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers (speculators uses spawn) get the index; each opens its own file handles.
        return {**self.__dict__, "_open": {}}

    def _slices(self, shard: int) -> tuple[list[LayerReader], Any]:
        if shard not in self._open:
            from safetensors import safe_open

            d = self.shard_dirs[shard]
            readers = [LayerReader(d / layer_file(i)) for i in self.layer_ids]
            self._open[shard] = (readers, safe_open(d / TOKEN_IDS, framework="pt"))
        readers, tokens = self._open[shard]
        return readers, tokens.get_slice("token_ids")

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        shard, offset, length, pos = self._rows[index]
        rec = tokenized_row_at(self._tokenized[shard], pos)
        readers, token_slice = self._slices(shard)
        a, b = offset, offset + length
        input_ids = token_slice[a:b]  # [T] int64
        if rec["seq_len"] != length or input_ids.tolist() != rec["input_ids"]:
            raise ValueError(f"row {rec['row']}: stored token ids differ from {self._tokenized[shard]}")
        return {
            "hidden_states": torch.cat([r.rows(a, b) for r in readers[:-1]], dim=-1),  # [T, (L-1)*H]
            "input_ids": input_ids,
            "verifier_last_hidden_states": readers[-1].rows(a, b),  # [T, H]
            "loss_mask": torch.tensor(rec["loss_mask"], dtype=torch.int64),  # [T]
            "lengths": torch.tensor([length], dtype=torch.long),  # [1]
            "position_ids": torch.arange(length, dtype=torch.long),  # [T]
        }
