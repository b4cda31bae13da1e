"""The drafts a dataset serves (config `layers.drafts`): which target layers each of speculators' algorithms reads.

speculators 0.9.0's trainer reads every draft type from the same hs rows, `hidden_states` [T, L, H]
(speculators/train/data.py): `hidden_states[:, :-1]` flattened are the auxiliary inputs, in the order of
`--target-layer-ids`, and `hidden_states[:, -1]` is `verifier_last_hidden_states`, the pre-norm final state
(id N), which eagle3, peagle, dflash, dflash2, dspark and xpress pass through `verifier_norm` and the lm_head
for their targets. Their `--target-layer-ids` default is [2, N//2, N-3] (models/utils.resolve_target_layer_ids),
in vLLM's numbering, which is ours (layers.py). mtp reads the final state alone (MTPDraftModel.target_layer_ids is
[N]; train/cli.py's shift_batch_mtp feeds `verifier_last_hidden_states` as its `hidden_states`).

So a draft reads `aux + [N]`: the run captures the union of its drafts' layers once (capture_layer_ids), and
the trainer gets, for each draft, a view of exactly those layers in that order (train/rows.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .layers import CONVENTION, check_layer_ids, convert_layer_ids, default_layer_ids, resolve_layer_ids

# speculators 0.9.0's --speculator-type values (SpeculatorModel.registry); FINAL_ONLY read id N alone.
ALGORITHMS = ("eagle3", "peagle", "dflash", "dflash2", "dspark", "xpress", "mtp")
FINAL_ONLY = frozenset({"mtp"})
WHERE = "layers.drafts"


@dataclass(frozen=True, slots=True)
class Draft:
    """One named draft: its speculators type and the target layers its trainer reads, in our numbering."""

    name: str
    type: str
    aux: tuple[int, ...]  # --target-layer-ids, in the order the trainer stacks them
    final: int  # N, the pre-norm final state: the last slot of every view

    @property
    def reads(self) -> list[int]:
        """The layer ids of the draft's view, in the order of its hs rows' `hidden_states` slots."""
        return [*self.aux, self.final]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "target_layer_ids": list(self.aux), "reads": self.reads}


def default_aux(draft_type: str, num_hidden_layers: int) -> list[int]:
    """speculators' default --target-layer-ids for the type ([2, N//2, N-3], repeats dropped on a shallow
    target); none for mtp."""
    if draft_type in FINAL_ONLY:
        return []
    return [i for i in default_layer_ids(num_hidden_layers) if i != num_hidden_layers]


def resolve_drafts(configured: Sequence[Mapping[str, Any]], num_hidden_layers: int) -> list[Draft]:
    """`layers.drafts` against the target's depth N; a ValueError naming the draft in one line."""
    n, drafts = num_hidden_layers, []
    for k, spec in enumerate(configured):
        kind = spec["type"]
        name = spec.get("name") or kind
        where = f"{WHERE}[{k}] ({name})"
        if kind not in ALGORITHMS:
            raise ValueError(f"{where}: type {kind!r} is not one of speculators' {', '.join(ALGORITHMS)}")
        ids, convention = spec.get("ids"), spec.get("convention") or CONVENTION
        if ids is None:
            aux = default_aux(kind, n)
        elif kind in FINAL_ONLY:
            raise ValueError(f"{where}: {kind} reads the pre-norm final state (id N = {n}) alone; give it no ids")
        else:
            ours = check_layer_ids(convert_layer_ids(ids, convention), n, where=f"{where}.ids", convention=convention)
            # id N is every draft's last slot already; speculators' DFlash converter drops it from the aux ids too
            aux = [i for i in ours if i != n]
        if name in {d.name for d in drafts}:
            raise ValueError(f"{where}: two drafts are named {name!r}; give each a distinct `name`")
        drafts.append(Draft(name, kind, tuple(aux), n))
    return drafts


def capture_layer_ids(
    ids: Sequence[int] | None, convention: str, drafts: Sequence[Mapping[str, Any]], num_hidden_layers: int
) -> list[int]:
    """The ids a run captures, ours: `layers.ids` (or, without drafts, the default [2, N//2, N-3, N]) extended by
    every draft's layers, ascending. Explicit ids are kept: drafts only add to them."""
    if not drafts:
        return resolve_layer_ids(list(ids) if ids is not None else None, convention, num_hidden_layers)
    base = resolve_layer_ids(list(ids), convention, num_hidden_layers) if ids is not None else []
    served = resolve_drafts(drafts, num_hidden_layers)
    return sorted(set(base).union(*(d.reads for d in served)))


# speculators' block drafts (--block-size) and those taking the verifier's whole vocabulary (no --draft-vocab-size)
BLOCK_DRAFTS = frozenset({"dflash", "dflash2", "dspark", "xpress"})
FULL_VOCAB = frozenset({"dflash2", "mtp"})


def trainer_args(
    draft: Draft, draft_vocab_size: int, num_layers: int = 1, block_size: int | None = None, attn: str = "sdpa"
) -> list[str]:
    """speculators train's flags for one draft: its type, its --target-layer-ids, and the flags its type takes
    (mtp: none of vocabulary, attention, loss or layers). eager loss and sdpa attention: the trainer's fused Triton
    loss and flex attention need a GPU compiler (docs/guides/training.md)."""
    kind = draft.type
    args = ["--speculator-type", kind, *(["--target-layer-ids", *map(str, draft.aux)] if draft.aux else [])]
    if kind not in FULL_VOCAB:
        args += ["--draft-vocab-size", str(draft_vocab_size)]
    if kind not in FINAL_ONLY:
        args += ["--loss-implementation", "eager", "--draft-attn-impl", attn, "--num-layers", str(num_layers)]
        args += ["--block-size", str(block_size)] if block_size and kind in BLOCK_DRAFTS else []
    return args


def missing_layers(drafts: Sequence[Draft], held: Sequence[int]) -> dict[str, list[int]]:
    """{draft name: the ids it reads that `held` (a dataset's layer ids) lacks}, for the drafts lacking any."""
    return {d.name: sorted(set(d.reads) - set(held)) for d in drafts if set(d.reads) - set(held)}


def draft_lines(
    drafts: Sequence[Draft], captured: Sequence[int], token_bytes: int | None = None, tokens: int | None = None
) -> list[str]:
    """One line a draft, then the union, for -n's opening lines and the plan: the ids each reads (ours) and, with
    the storage format's bytes per token per layer and the tokens, the bytes it reads."""  # fmt: skip

    def size(layers: int) -> str:
        if token_bytes is None:
            return ""
        per = f"{layers * token_bytes:,} B/token"
        return f", {per}, {_gb(layers * token_bytes * tokens)}" if tokens is not None else f", {per}"

    lines = [
        f"draft {d.name} ({d.type}) reads layers {d.reads} "
        f"(--target-layer-ids {' '.join(map(str, d.aux)) or '(none: the final state only)'}){size(len(d.reads))}"
        for d in drafts
    ]
    lines.append(f"captured once for all drafts: the union {list(captured)} ({CONVENTION}){size(len(captured))}")
    return lines


def plan_drafts(
    drafts: Sequence[Mapping[str, Any]], ids: list[int], per_layer: int, tokens: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """The plan's part: ([{draft..., bytes_per_token, bytes}], its lines), `per_layer` the storage format's bytes per
    token per layer. With drafts the captured ids end with N: every draft reads it."""
    served = resolve_drafts(drafts, ids[-1])
    return draft_table(served, per_layer, tokens), draft_lines(served, ids, per_layer, tokens)


def draft_table(drafts: Sequence[Draft], per_layer: int, tokens: int) -> list[dict[str, Any]]:
    """[{draft..., bytes_per_token, bytes}]: what a token of each draft's view and all `tokens` of it read, at
    `per_layer` bytes per token per layer (the plan's and the report's numbers)."""
    return [
        {**d.to_json(), "bytes_per_token": len(d.reads) * per_layer, "bytes": len(d.reads) * per_layer * tokens}
        for d in drafts
    ]


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"
