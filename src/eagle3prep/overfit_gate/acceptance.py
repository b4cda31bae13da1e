"""The gate's numbers: vLLM's spec-decode counters -> acceptance, and the verdict against the bound.

vLLM (v1) counts, over every decode step that drafted: `vllm:spec_decode_num_drafts` (steps that
drafted), `..._num_draft_tokens` (drafts x k), `..._num_accepted_tokens` and
`..._num_accepted_tokens_per_pos` (a vector of k: how many drafts had their i-th token accepted; a
token is accepted only when every earlier one was). A step emits its accepted tokens plus the target's
own next one, so the mean acceptance length (tokens per target forward) is 1 + accepted / drafts,
between 1 and 1 + k, and per-position acceptance is per_pos[i] / drafts, non-increasing in i.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PREFIX = "vllm:spec_decode_"
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = "num_accepted_tokens_per_pos"

# The bound sits between what a draft overfit on correct rows accepts and the closest planted mistake
# (figures: DESIGN.md §6a). Positions are judged, not only the mean: that mistake costs the deeper positions.
MIN_ACCEPTANCE_PER_POSITION = 0.9  # each position i: per_pos[i] / drafts
MIN_DRAFTS = 8  # fewer drafting steps than this are no measurement


@dataclass(frozen=True, slots=True)
class Acceptance:
    k: int
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: list[int]

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else float("nan")

    @property
    def per_position(self) -> list[float]:
        return [a / self.drafts if self.drafts else float("nan") for a in self.accepted_per_position]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "max_acceptance_length": 1 + self.k,
            "acceptance_per_position": [round(x, 4) for x in self.per_position],
            "acceptance_rate": round(self.acceptance_rate, 4),
        }


def counters(metrics: list[Any]) -> dict[str, Any]:
    """{name without the prefix: value} of the spec-decode metrics in `LLM.get_metrics()`'s list
    (Counter objects carry `.value`, the per-position Vector `.values`)."""
    out: dict[str, Any] = {}
    for m in metrics:
        if m.name.startswith(PREFIX):
            values = getattr(m, "values", None)
            out[m.name[len(PREFIX) :]] = list(values) if values is not None else getattr(m, "value", None)
    return out


def difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The counters of one generate call: vLLM's count from the engine start."""
    out = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old or [0] * len(value)
            out[name] = [a - b for a, b in zip(value, old, strict=True)]
        else:
            out[name] = value - (old or 0)
    return out


def total(specs: list[dict[str, Any]]) -> dict[str, Any]:
    """The counters of several prompts added up (`difference()` with the sign turned)."""
    out: dict[str, Any] = {}
    for spec in specs:
        for name, value in spec.items():
            if isinstance(value, list):
                out[name] = [a + b for a, b in zip(out.get(name, [0] * len(value)), value, strict=True)]
            else:
                out[name] = out.get(name, 0) + value
    return out


def zero(k: int) -> dict[str, Any]:
    """The counters of no drafting at all."""
    return {**dict.fromkeys(COUNTERS, 0), PER_POS: [0] * k}


def acceptance(spec: dict[str, Any], k: int) -> Acceptance:
    """Acceptance from the counters (`counters()`, or `difference()` of two). A missing counter is an
    error: this vLLM reports spec decoding under other names, and the gate would measure nothing."""
    missing = [n for n in (*COUNTERS, PER_POS) if n not in spec]
    if missing:
        raise ValueError(f"vLLM reported no {', '.join(PREFIX + n for n in missing)} (got {sorted(spec)})")
    per_pos = [int(x) for x in spec[PER_POS]]
    if len(per_pos) != k:
        raise ValueError(f"{PREFIX}{PER_POS} has {len(per_pos)} positions, num_speculative_tokens is {k}")
    return Acceptance(
        k, int(spec["num_drafts"]), int(spec["num_draft_tokens"]), int(spec["num_accepted_tokens"]), per_pos
    )


def bound(k: int) -> dict[str, Any]:
    """What the verdict requires, as the JSON records it."""
    return {
        "min_acceptance_per_position": MIN_ACCEPTANCE_PER_POSITION,
        "min_mean_acceptance_length": round(1 + k * MIN_ACCEPTANCE_PER_POSITION, 4),
        "min_drafts": MIN_DRAFTS,
        "rule": "every position i of k: accepted_per_pos[i] / drafts >= min_acceptance_per_position "
        "(so mean acceptance length >= 1 + k * it), over at least min_drafts drafting steps",
    }


def verdict(acc: Acceptance, judged: int, prompts: int) -> tuple[str, str]:
    """("pass" | "fail", one line saying why). `acc` pools the `judged` prompts of `prompts` whose served
    reply is the regenerated one (the rows the draft was trained on); at least half must be."""
    if 2 * judged < prompts:
        return "fail", (
            f"the target served with the draft wrote other replies than alone on {prompts - judged} of {prompts} "
            "prompts (greedy near-ties decided apart: numerics, not the draft); nothing to judge the draft on"
        )
    if acc.drafts < MIN_DRAFTS:
        return "fail", f"only {acc.drafts} drafting steps (< {MIN_DRAFTS}): vLLM barely drafted"
    low = [(i, r) for i, r in enumerate(acc.per_position) if not r >= MIN_ACCEPTANCE_PER_POSITION]
    line = (
        f"mean acceptance length {acc.mean_acceptance_length:.3f} of {1 + acc.k}, per position "
        f"{' '.join(f'{r:.3f}' for r in acc.per_position)} over {acc.drafts} drafts of {judged}/{prompts} prompts"
    )
    if low:
        where = ", ".join(f"position {i + 1}: {r:.3f}" for i, r in low)
        return "fail", f"{line}; below {MIN_ACCEPTANCE_PER_POSITION} at {where}"
    return "pass", line
