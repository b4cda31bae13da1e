"""The validated config as frozen, typed settings, built here and nowhere else (DESIGN.md §5, "Settings").

config/schema.yaml holds every default: `validate_config` fills them in, `from_config` reads the result, and
callers without a whole config (benches, tests) ask `defaults(**values)`, which fills the same schema's.
A stage's settings are split by structure: `content` decides what a job writes (the rule's params, its rerun
trigger) and `speed` how fast it goes and what it needs (read from the config as it is now: lowering
gpu_memory_utilization after an out-of-memory crash must not redo the finished shards). vLLM is not
batch-invariant: a shard redone with another batch size can differ in the last bits, not in what it means.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

# A content field added after results existed: left out of the rule's params while at its schema default,
# because Snakemake compares params as a whole and a new key would re-queue every finished job made before it.
LATER = {"params": "unless_default"}
# extract.* keys the schema still accepts so that old configs load, and nothing reads.
UNUSED = {"extract": frozenset({"staging_dir"})}


@functools.cache
def _schema() -> dict[str, Any]:
    from .config import SCHEMA

    return yaml.safe_load(Path(SCHEMA).read_text(encoding="utf-8"))


def section_defaults(section: str, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`values` for config section `section`, checked and completed with the schema's defaults."""
    import jsonschema

    from .config import ConfigError, _one_line, _with_defaults

    instance = {section: copy.deepcopy(dict(values or {}))}
    validator = _with_defaults(jsonschema.Draft202012Validator)(_schema())
    errors = [e for e in validator.iter_errors(instance) if list(e.absolute_path)[:1] == [section]]
    if errors:
        raise ConfigError(_one_line(sorted(errors, key=lambda e: list(e.absolute_path))[0]))
    return instance[section]


def _build(cls: type, section: Mapping[str, Any]) -> Any:
    """`cls` from the keys of a validated section named like its fields (nested dataclasses by their own)."""
    values = {}
    for f in fields(cls):
        if f.name in _FIELD_TYPES.get(cls, {}):  # a part of the settings, read from the same section
            values[f.name] = _build(_FIELD_TYPES[cls][f.name], section)
        elif f.name not in section:
            raise KeyError(f"{f.name}: settings are built from a validated config section (validate_config)")
        else:
            values[f.name] = section[f.name]
    return cls(**values)


def _params(content_cls: type, section: Mapping[str, Any], schema_section: str) -> dict[str, Any]:
    """The keys of `section` that are fields of `content_cls`, in the section's order (Snakemake compares the
    params' repr, so the order a user wrote stays), a LATER field left out at its schema default."""
    props = _schema()["properties"][schema_section]["properties"]
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


@dataclass(frozen=True, slots=True)
class ExtractSettings:
    """The extract stage's settings (config `extract:`)."""

    content: ExtractContent
    speed: ExtractSpeed

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ExtractSettings:
        """From a config that validate_config has checked and completed."""
        return _build(cls, config["extract"])

    @classmethod
    def defaults(cls, **values: Any) -> ExtractSettings:
        """`values` (extract.* keys) over the schema's defaults: for benches and tests without a config."""
        return _build(cls, section_defaults("extract", values))

    @staticmethod
    def params(config: Mapping[str, Any]) -> dict[str, Any]:
        """The extract rule's params: the content keys of the validated config's `extract:`."""
        return _params(ExtractContent, config["extract"], "extract")


_FIELD_TYPES: dict[type, dict[str, type]] = {ExtractSettings: {"content": ExtractContent, "speed": ExtractSpeed}}
