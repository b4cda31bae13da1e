"""The regenerate.* settings as the job uses them: sampling, turn mode, thinking, what happens to a cut or empty
reply, and which keys are the rule's params (its rerun trigger) and which are speed knobs."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

# regenerate.* keys that change how fast a shard is made, not what it holds: kept out of the regenerate rule's
# params (Snakemake re-queues a job whose params changed), like config.SPEED_KEYS for extract. vLLM is not
# batch-invariant, so a shard redone with another batch size can differ in the last bits of a logit and, where
# two tokens are that close, in the text that follows; docs/guides/regeneration.md says so.
SPEED_KEYS = frozenset(
    {"gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_in_flight", "threads"}
)
# Keys that shape the DAG (enabled, num_shards: the split job's outputs) or only the review rule.
NOT_PARAMS = SPEED_KEYS | {"enabled", "num_shards", "review_samples"}

TURN_MODES = ("all", "last")
THINKING_MODES = ("auto", "keep", "strip")
LENGTH_POLICIES = ("keep", "quarantine")
EMPTY_POLICIES = ("quarantine", "keep")
SEED_RULE = "int(sha256(f'{seed}:{conversation id}')[:8], 16) & 0x7fffffff (the prepared conversation's id)"


def data_params(section: dict[str, Any], chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The regenerate.* settings that decide a shard's contents: the regenerate rule's params. With them, when set,
    tokenize.chat_template_kwargs (the prompts are rendered with them); left out at {}, so that a shard made before
    the key existed is not re-queued (Snakemake compares params as a whole)."""
    params = {k: v for k, v in section.items() if k not in NOT_PARAMS}
    return {**params, "chat_template_kwargs": chat_template_kwargs} if chat_template_kwargs else params


def job_options(params: dict[str, Any], config_section: dict[str, Any]) -> dict[str, Any]:
    """The job's options: the speed keys from the config as it is now, the rest from the rule's params."""
    return {**{k: v for k, v in config_section.items() if k in SPEED_KEYS}, **params}


def conversation_seed(base: int, conversation_id: str) -> int:
    """The seed of one conversation's requests: fixed by the base seed and the conversation's content id, so a
    rerun, another shard count or another order of the data gives the conversation the same seed."""
    digest = hashlib.sha256(f"{base}:{conversation_id}".encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


@dataclass(frozen=True, slots=True)
class Sampling:
    """regenerate.sampling: greedy by default (temperature 0), where the seed does not matter."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None  # None or 0: no top-k
    max_tokens: int = 1024
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "greedy": self.greedy, "seed_rule": SEED_RULE}


@dataclass(frozen=True, slots=True)
class Settings:
    """What one regenerate job needs to know besides the model; built from the config by `from_config`."""

    sampling: Sampling = field(default_factory=Sampling)
    turns: str = "all"  # all: a reply to every user turn; last: only the last assistant turn
    thinking: str = "auto"  # auto | keep | strip (thinking.resolve says what auto becomes)
    thinking_markers: tuple[str, str] = ("<think>", "</think>")
    on_length: str = "keep"  # a reply cut by max_tokens: keep it, or quarantine the conversation
    on_empty: str = "quarantine"  # an empty reply: quarantine the conversation, or keep it
    max_model_len: int | None = None  # prompt + reply tokens per request; None: the model's context
    max_in_flight: int = 4096  # conversations admitted and not yet written (bounds host memory)

    def __post_init__(self) -> None:
        for name, allowed in (
            ("turns", TURN_MODES),
            ("thinking", THINKING_MODES),
            ("on_length", LENGTH_POLICIES),
            ("on_empty", EMPTY_POLICIES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"regenerate.{name} = {getattr(self, name)!r}; choose one of {list(allowed)}")
        if len(self.thinking_markers) != 2 or not all(self.thinking_markers):
            raise ValueError(f"regenerate.thinking_markers = {list(self.thinking_markers)}: two non-empty strings")

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> Settings:
        """From the regenerate section (schema defaults filled in); keys the job does not read are ignored."""
        sampling = Sampling(**(section.get("sampling") or {}))
        return cls(
            sampling=sampling,
            turns=section.get("turns", "all"),
            thinking=section.get("thinking", "auto"),
            thinking_markers=tuple(section.get("thinking_markers") or ("<think>", "</think>")),
            on_length=section.get("on_length", "keep"),
            on_empty=section.get("on_empty", "quarantine"),
            max_model_len=section.get("max_model_len"),
            max_in_flight=int(section.get("max_in_flight") or 4096),
        )

    def policy_json(self) -> dict[str, Any]:
        return {"turns": self.turns, "on_length": self.on_length, "on_empty": self.on_empty}
