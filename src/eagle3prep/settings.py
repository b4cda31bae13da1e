"""The validated config as frozen, typed settings, built here and nowhere else (DESIGN.md §5, "Settings").

config/schema.yaml holds every default: `validate_config` fills them in, `from_config` reads the result, and
callers without a whole config (benches, tests) ask `defaults(**values)`, which fills the same schema's.
A stage's settings are split by structure: `content` decides what a job writes (the rule's params, its rerun
trigger) and `speed` how fast it goes and what it needs (read from the config as it is now: lowering
gpu_memory_utilization after an out-of-memory crash must not redo the finished shards). vLLM is not
batch-invariant: a shard redone with another batch size can differ in the last bits, not in what it means.
Keys that shape the DAG rather than a job's output (regenerate's `workflow`) are a part of their own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Self

from .config import load_schema, section_defaults

# A content field added after results existed: left out of the rule's params while at its schema default,
# because Snakemake compares params as a whole and a new key would re-queue every finished job made before it.
LATER = {"params": "unless_default"}
# extract.* keys the schema still accepts so that old configs load, and nothing reads.
UNUSED = {"extract": frozenset({"staging_dir"})}


def _build(cls: type, section: Mapping[str, Any]) -> Any:
    """`cls` from the keys of a validated section named like its fields (nested dataclasses by their own)."""
    values = {}
    for f in fields(cls):
        if f.name in _FIELD_TYPES.get(cls, {}):  # a part of the settings, read from the same section
            values[f.name] = _build(_FIELD_TYPES[cls][f.name], section)
        elif f.name not in section:
            raise KeyError(f"{f.name}: settings are built from a validated config section (validate_config)")
        elif f.name in _SUBSECTIONS.get(cls, {}):  # a mapping of the section (regenerate.sampling)
            values[f.name] = _build(_SUBSECTIONS[cls][f.name], section[f.name])
        else:
            values[f.name] = section[f.name]
    return cls(**values)


def _params(content_cls: type, section: Mapping[str, Any], schema_section: str) -> dict[str, Any]:
    """The keys of `section` that are fields of `content_cls`, in the section's order (Snakemake compares the
    params' repr, so the order a user wrote stays), a LATER field left out at its schema default."""
    props = load_schema()["properties"][schema_section]["properties"]
    kinds = {f.name: f.metadata for f in fields(content_cls)}
    return {
        k: v for k, v in section.items() if k in kinds and not (kinds[k] == LATER and v == props[k].get("default"))
    }


@dataclass(frozen=True, slots=True)
class ExtractContent:
    """extract.* that decides a shard's bytes: the extract rule's params."""

    backend: str  # hf | vllm
    device: str  # the hf backend's: cpu | cuda
    dtype: str  # bfloat16 | float16 | float32
    storage: str = field(metadata=LATER)  # model_dtype | fp8_e4m3 (shard.layout.STORAGES)
    logprob_rows: int
    tp_size: int
    enforce_eager: bool
    capture_path: str  # vllm: auto | builtin | hooks
    quantization: str | None
    engine_args: Mapping[str, Any]  # passed to vllm.LLM as they are; read, never changed


@dataclass(frozen=True, slots=True)
class ExtractSpeed:
    """extract.* that sets how fast a shard is made and what it needs, never its contents."""

    batch_tokens: int  # tokens per forward batch: the hf backend's step and the vllm driver's window
    threads: int
    gpu_memory_utilization: float
    max_num_batched_tokens: int


class _StageSettings:
    """How a stage's settings are made: from a validated config, or from the schema's defaults."""

    __slots__ = ()
    SECTION: ClassVar[str]  # the config section, e.g. "extract"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        """From a config that validate_config has checked and completed."""
        return _build(cls, config[cls.SECTION])

    @classmethod
    def defaults(cls, **values: Any) -> Self:
        """`values` (the section's keys) over the schema's defaults: for benches and tests without a config."""
        return _build(cls, section_defaults(cls.SECTION, values))


@dataclass(frozen=True, slots=True)
class ExtractSettings(_StageSettings):
    """The extract stage's settings (config `extract:`)."""

    SECTION: ClassVar[str] = "extract"
    content: ExtractContent
    speed: ExtractSpeed

    @staticmethod
    def params(config: Mapping[str, Any]) -> dict[str, Any]:
        """The extract rule's params: the content keys of the validated config's `extract:`."""
        return _params(ExtractContent, config["extract"], "extract")


# The regenerate stage's seed of one conversation's requests; the manifest records this text beside the seed.
SEED_RULE = "int(sha256(f'{seed}:{conversation id}')[:8], 16) & 0x7fffffff (the prepared conversation's id)"


def conversation_seed(base: int, conversation_id: str) -> int:
    """The seed of one conversation's requests (SEED_RULE): fixed by the base seed and the conversation's content
    id, so a rerun, another shard count or another order of the data gives the conversation the same seed."""
    digest = hashlib.sha256(f"{base}:{conversation_id}".encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


@dataclass(frozen=True, slots=True)
class Sampling:
    """regenerate.sampling: greedy at temperature 0, where the seed does not matter."""

    temperature: float
    top_p: float
    top_k: int | None  # None or 0: no top-k
    max_tokens: int
    seed: int  # the base of each conversation's seed (conversation_seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "greedy": self.greedy, "seed_rule": SEED_RULE}


@dataclass(frozen=True, slots=True)
class RegenerateContent:
    """regenerate.* that decides a shard's conversations: the regenerate rule's params."""

    turns: str  # all: a reply to every user turn; last: only the last assistant turn
    thinking: str  # auto | keep | strip (regenerate.thinking.resolve says what auto becomes)
    thinking_markers: Sequence[str]  # the two strings around a reply's thinking
    on_length: str  # a reply cut by max_tokens: keep | quarantine
    on_empty: str  # an empty reply: quarantine | keep
    sampling: Sampling
    max_model_len: int | None  # prompt + reply tokens per request; None: tokenize.max_seq_len (stage.model_len)
    dtype: str
    tp_size: int
    enforce_eager: bool
    quantization: str | None
    engine_args: Mapping[str, Any]  # passed to vllm.LLM as they are; read, never changed

    def policy_json(self) -> dict[str, Any]:
        return {"turns": self.turns, "on_length": self.on_length, "on_empty": self.on_empty}


@dataclass(frozen=True, slots=True)
class RegenerateSpeed:
    """regenerate.* that sets how fast a shard is made and what it needs, never its contents."""

    gpu_memory_utilization: float
    max_num_seqs: int | None  # None: vLLM's default
    max_num_batched_tokens: int | None  # None: vLLM's default
    max_in_flight: int  # conversations admitted and not yet written (bounds host memory)
    threads: int


@dataclass(frozen=True, slots=True)
class RegenerateWorkflow:
    """regenerate.* that shapes the DAG (whether the stage exists, its jobs) or only the review rule."""

    enabled: bool
    num_shards: int
    review_samples: int


@dataclass(frozen=True, slots=True)
class RegenerateSettings(_StageSettings):
    """The regenerate stage's settings (config `regenerate:`); the gate's engines use them too."""

    SECTION: ClassVar[str] = "regenerate"
    content: RegenerateContent
    speed: RegenerateSpeed
    workflow: RegenerateWorkflow

    @staticmethod
    def params(config: Mapping[str, Any]) -> dict[str, Any]:
        """The regenerate rule's params: the content keys of the validated config's `regenerate:`, and
        tokenize.chat_template_kwargs when set (the prompts render with them; left out at {}, like a LATER
        field, so that a shard made before the key existed is not re-queued)."""
        params = _params(RegenerateContent, config["regenerate"], "regenerate")
        kwargs = config["tokenize"]["chat_template_kwargs"]
        return {**params, "chat_template_kwargs": kwargs} if kwargs else params


_FIELD_TYPES: dict[type, dict[str, type]] = {
    ExtractSettings: {"content": ExtractContent, "speed": ExtractSpeed},
    RegenerateSettings: {"content": RegenerateContent, "speed": RegenerateSpeed, "workflow": RegenerateWorkflow},
}
_SUBSECTIONS: dict[type, dict[str, type]] = {RegenerateContent: {"sampling": Sampling}}
