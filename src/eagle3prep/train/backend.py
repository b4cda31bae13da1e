"""speculators' hidden-states backend `eagle3prep`: training rows served straight from the shard folders.

Importing this module registers the backend with hs_connectors (`HiddenStatesBackend.registry`), which
speculators' trainer reads for `--hidden-states-backend`. It must be imported before
`speculators.train.config` (that module collects every backend's train arguments once, at import);
`eagle3prep-train` (eagle3prep.train.cli) does that, then runs speculators' own trainer.

speculators' ArrowDataset calls `transfer.get_cached(i)` for arrow row i (plus the split's offset) and
expects FileTransfer's `hs_{i}.safetensors` contents; `ShardTransfer` returns the same tensors from the
shards (eagle3prep.train.rows), so a direct export (`export.hidden_states: direct`) needs no hs files.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer

from .rows import ExportRows

BACKEND = "eagle3prep"


class ShardTransfer(HiddenStatesTransfer):
    """speculators' transfer interface over ExportRows (picklable for spawned DataLoader workers)."""

    def __init__(self, rows: ExportRows):
        self.rows = rows

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        return self.rows.get(file_idx)

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        # Every row of the export was captured and validated by the workflow; a row without hidden states
        # means the export and the shards disagree, which asking a vLLM server would hide.
        raise RuntimeError(
            "the eagle3prep backend serves the workflow's captured rows only and generates none; "
            "train with --on-missing raise, and rerun the export if a row is missing"
        )


class Eagle3PrepBackend(HiddenStatesBackend):
    """`--hidden-states-backend eagle3prep`: --data-path is an eagle3prep export (either mode)."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--eagle3prep-shards",
            type=str,
            default=None,
            help="Folder holding the shard_{k}/ folders the export was made from, when it moved (default: "
            "where its manifest.json recorded them, else results/hidden_states beside the export).",
        )

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """No vLLM server is launched for this backend: the workflow's extract jobs captured every row."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> ShardTransfer:
        # getattr: the flag exists only when this module was imported before speculators.train.config.
        rows = ExportRows.from_export(data_path, getattr(args, "eagle3prep_shards", None))
        return ShardTransfer(rows.with_view(draft_view(args, rows.layer_ids)))

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise ValueError(
            "the eagle3prep backend reads hidden states the workflow already captured; there is no vLLM "
            "connector to configure (capture with `snakemake`, extract.backend: vllm)"
        )


def draft_view(args: argparse.Namespace, captured: list[int]) -> list[int]:
    """The layers the draft being trained reads, in the order its trainer stacks them (eagle3prep.drafts): its
    --target-layer-ids (speculators' default [2, N//2, N-3] when not given; none for mtp), then N, the
    pre-norm final state every export ends with."""
    from ..drafts import FINAL_ONLY

    n = captured[-1]
    kind = getattr(args, "speculator_type", "eagle3")
    if kind in FINAL_ONLY:
        return [n]
    aux = getattr(args, "target_layer_ids", None)
    if aux is None:  # what the draft model itself resolves (it warns that the default is taken)
        from speculators.models.utils import resolve_target_layer_ids

        aux = resolve_target_layer_ids(None, args.verifier_name_or_path, getattr(args, "trust_remote_code", False))
    return [*aux, n]


if BACKEND not in HiddenStatesBackend.registry:  # a second import (another module name) must not raise
    HiddenStatesBackend.register(BACKEND)(Eagle3PrepBackend)
