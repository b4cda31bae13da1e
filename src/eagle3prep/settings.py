"""The validated config as frozen, typed settings, built here and nowhere else (DESIGN.md §5, "Settings"):
one class a schema section (tests/test_settings.py holds each to the schema's keys), `Settings` the whole.

The schema (src/eagle3prep/config/schema.yaml) holds every default: `validate_config` fills them in, `from_config` reads the result, and
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
from pathlib import Path
from typing import Any, ClassVar, Self

from .config import load_schema, reference_mode, schema_default, section_defaults, validate_config
from .config.model import model_layer_ids
from .layers import CONVENTION

# A content field added after results existed: left out of the rule's params while at its schema default,
# because Snakemake compares params as a whole and a new key would re-queue every finished job made before it.
LATER = {"params": "unless_default"}
# extract.* keys the schema still accepts so that old configs load, and nothing reads.
UNUSED = {"extract": frozenset({"staging_dir"})}
IMAGE_KEYS = ("image_root", "max_image_pixels")  # the data.* keys of rows with images


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
    storage: str = field(metadata=LATER)  # shard/formats.py STORAGES: model_dtype | fp8_e4m3 | mxfp4
    logprob_rows: int  # the config's auto resolved (config.schema.logprob_rows)
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


class _Section:
    """How a section's settings are made: from a validated config, or from the schema's defaults."""

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

    @classmethod
    def of(cls, section: Mapping[str, Any]) -> Self:
        """From the validated section itself, as a rule hands it to a job in its params."""
        return _build(cls, section)

    def params_when_set(self, *keys: str) -> dict[str, Any]:
        """`keys` as rule params, each only away from its schema default: keys added after runs existed, left out
        at their defaults like a LATER field, so that a run made before them is not re-queued."""
        return {k: getattr(self, k) for k in keys if getattr(self, k) != schema_default(self.SECTION, k)}


@dataclass(frozen=True, slots=True)
class ExtractSettings(_Section):
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
class RegenerateSettings(_Section):
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
        return {**params, **TokenizeSettings.from_config(config).template_kwargs_params()}


@dataclass(frozen=True, slots=True)
class DataSettings(_Section):
    """Where the conversations come from and what prepare accepts (config `data:`)."""

    SECTION: ClassVar[str] = "data"
    sources: Sequence[str]  # files or globs as written; run.parse.config_sources expands them
    max_line_bytes: int
    allow_no_user_turn: bool
    image_root: str | None
    max_image_pixels: int
    max_quarantine_share: float  # not a param of the prepare rule: it decides no byte (run_prepare_job reads it)

    def image_params(self) -> dict[str, Any]:
        """The prepare rule's image params: IMAGE_KEYS, each only when set."""
        return self.params_when_set(*IMAGE_KEYS)


@dataclass(frozen=True, slots=True)
class ModelSettings(_Section):
    """The target model's folder (config `model:`)."""

    SECTION: ClassVar[str] = "model"
    path: str
    build_demo: bool
    trust_remote_code: bool


@dataclass(frozen=True, slots=True)
class TokenizeSettings(_Section):
    """How conversations become rows (config `tokenize:`)."""

    SECTION: ClassVar[str] = "tokenize"
    max_seq_len: int
    num_shards: int
    workers: int
    template_fallback: bool
    chat_template_kwargs: Mapping[str, Any]  # given to every render; read, never changed

    def template_kwargs_params(self) -> dict[str, Any]:
        """chat_template_kwargs as rule params, only when set."""
        return self.params_when_set("chat_template_kwargs")


@dataclass(frozen=True, slots=True)
class LayersSettings(_Section):
    """Which layers a shard holds, in the user's convention (config `layers:`; layers.py converts)."""

    SECTION: ClassVar[str] = "layers"
    ids: Sequence[int] | None  # None: layers.default_layer_ids of the model's depth
    convention: str  # input_of_layer | output_of_layer | vllm | speculators
    drafts: Sequence[Mapping[str, Any]] = field(default_factory=list, metadata=LATER)  # each adds its layers

    @classmethod
    def of(cls, section: Mapping[str, Any]) -> Self:
        """From a rule's `layers` param, which leaves `drafts` out when there are none (params below)."""
        return _build(cls, {"drafts": [], **section})

    def capture_ids(self, num_hidden_layers: int) -> list[int]:
        """The ids the run captures (ours): layers.ids extended by every draft's layers (drafts.capture_layer_ids)."""
        from .drafts import capture_layer_ids

        return capture_layer_ids(self.ids, self.convention, self.drafts, num_hidden_layers)

    @staticmethod
    def params(config: Mapping[str, Any]) -> dict[str, Any]:
        """The rules' `layers` param (a rerun trigger): the section as written, `drafts` left out. Drafts that
        add layers make it the captured ids themselves, so that naming a draft the finished shards already
        serve re-queues no shard (the demo's depth is known before model.build_demo builds it); without a model
        folder to read N from, the drafts themselves, resolved by the job."""
        section = config["layers"]
        base = {k: v for k, v in section.items() if k != "drafts"}
        if not section.get("drafts"):
            return base
        try:
            n = _model_depth(config["model"]["path"], config["model"]["build_demo"])
        except (OSError, ValueError, KeyError):
            return dict(section)
        union = LayersSettings.of(section).capture_ids(n)
        if union == LayersSettings.of(base).capture_ids(n):
            return base
        return {"ids": union, "convention": CONVENTION}


@dataclass(frozen=True, slots=True)
class ValidateSettings(_Section):
    """How each shard is checked against the target (config `validate:`)."""

    SECTION: ClassVar[str] = "validate"
    sample_rows: int | str  # an integer or auto
    seed: int
    device: str  # cpu | cuda
    reference: bool | str  # true | false | full | scalable | off (reference_mode reads it)
    windows: Sequence[Sequence[int]] | None
    overfit_gate: bool

    @property
    def reference_mode(self) -> str:
        return reference_mode(self.reference)


@dataclass(frozen=True, slots=True)
class ExportSettings(_Section):
    """Whether and how the training export is written (config `export:`)."""

    SECTION: ClassVar[str] = "export"
    speculators: bool
    hidden_states: str  # copy | direct


@dataclass(frozen=True, slots=True)
class PlanSettings(_Section):
    """The figures `snakemake plan` estimates a run's time from (config `plan:`)."""

    SECTION: ClassVar[str] = "plan"
    tokens_per_s: float | None
    engine_start_s: float


@dataclass(frozen=True, slots=True)
class HealSettings(_Section):
    """What the next run does with a shard that failed validation (config `heal:`)."""

    SECTION: ClassVar[str] = "heal"
    keep_failed: bool


SECTIONS: tuple[type[_Section], ...] = (
    DataSettings,
    ModelSettings,
    TokenizeSettings,
    LayersSettings,
    ExtractSettings,
    ValidateSettings,
    ExportSettings,
    PlanSettings,
    HealSettings,
    RegenerateSettings,
)
TOP_LEVEL = ("replace_results",)  # schema keys that are a value, not a section


@dataclass(frozen=True, slots=True)
class Settings:
    """The whole validated config, one typed part a section; rules/common.smk builds it once, as SETTINGS."""

    data: DataSettings
    model: ModelSettings
    tokenize: TokenizeSettings
    layers: LayersSettings
    extract: ExtractSettings
    validate: ValidateSettings
    export: ExportSettings
    plan: PlanSettings
    heal: HealSettings
    regenerate: RegenerateSettings
    replace_results: bool  # a run may replace another config's finished shards (made_by)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Settings:
        """From a config that validate_config has checked and completed."""
        parts = {c.SECTION: c.from_config(config) for c in SECTIONS}
        return cls(**parts, **{k: config[k] for k in TOP_LEVEL})

    @classmethod
    def validated(cls, config: dict[str, Any], kept_logprob_rows: int | None = None) -> Settings:
        """`config` validated in place (validate_config: defaults filled in, one-line ConfigError), then typed."""
        return cls.from_config(validate_config(config, kept_logprob_rows))

    def layer_ids(self) -> list[int]:
        """The layer ids the run captures, in our convention (its drafts' included); needs the model folder (N)."""
        return model_layer_ids(self.model.path, self.layers.ids, self.layers.convention, self.layers.drafts)


def _model_depth(model_path: str, build_demo: bool) -> int:
    from .model_facts import ModelFacts

    if build_demo and not (Path(model_path) / "config.json").is_file():
        from .demo import NUM_HIDDEN_LAYERS

        return NUM_HIDDEN_LAYERS
    return ModelFacts.read(model_path).num_hidden_layers


_FIELD_TYPES: dict[type, dict[str, type]] = {
    ExtractSettings: {"content": ExtractContent, "speed": ExtractSpeed},
    RegenerateSettings: {"content": RegenerateContent, "speed": RegenerateSpeed, "workflow": RegenerateWorkflow},
}
_SUBSECTIONS: dict[type, dict[str, type]] = {RegenerateContent: {"sampling": Sampling}}
