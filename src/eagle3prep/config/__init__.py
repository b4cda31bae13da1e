"""The config layer: its schema (schema.yaml, package data) and its defaults (schema.py), and the checks a value gets beyond the
schema, each in one line: the chat template's own arguments (template.py), what the vLLM engine cannot be
given (engine.py), the model folder (model.py). validate_config runs those a config needs before any job;
eagle3prep.settings types the result."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..layers import convert_layer_ids
from .engine import check_extract_engine_args
from .schema import SCHEMA, check_schema, load_schema, logprob_rows, reference_mode, schema_default, section_defaults
from .template import check_template_kwargs

__all__ = [
    "SCHEMA",
    "ConfigError",
    "load_schema",
    "logprob_rows",
    "reference_mode",
    "schema_default",
    "section_defaults",
    "validate_config",
]


def validate_config(config: dict[str, Any], kept_logprob_rows: int | None = None) -> dict[str, Any]:
    """Validate `config` in place (defaults filled in, extract.logprob_rows as a count, at least
    `kept_logprob_rows`: schema.logprob_rows) and return it; raise ConfigError on the first error."""
    check_schema(config)
    extract = config["extract"]  # the value replaced in place: the params' order stays the schema's
    extract["logprob_rows"] = logprob_rows(extract["logprob_rows"], config["validate"]["reference"], kept_logprob_rows)
    check_template_kwargs(config["tokenize"]["chat_template_kwargs"])
    check_extract_engine_args(config["extract"]["engine_args"], config["tokenize"]["max_seq_len"])
    if config["layers"]["ids"] is not None:
        try:  # fails early on a bad convention; the range check needs the model (layer_ids below)
            convert_layer_ids(config["layers"]["ids"], config["layers"]["convention"])
        except ValueError as e:
            raise ConfigError(f"config error: {e}") from None
    return config
