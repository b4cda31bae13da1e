"""The config's schema (schema.yaml beside this module, shipped in the package): read once, its defaults (schema_default, section_defaults), and a config checked against it
with the defaults filled in (check_schema), each error one line that names the key, the value and what is
allowed. Command-line values, which reach the config as strings, are read as the schema's types first."""

from __future__ import annotations

import copy
import difflib
import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError

# Package data (pyproject.toml): an installed package finds it beside its code (tests/test_packaging.py).
SCHEMA = Path(__file__).with_name("schema.yaml")


@functools.cache
def load_schema() -> dict[str, Any]:
    """The schema, read once (callers must not change it: schema_default hands out copies)."""
    return yaml.safe_load(SCHEMA.read_text(encoding="utf-8"))


# What extract.logprob_rows: auto asks for under validate.reference scalable, whose logits check reads them.
SCALABLE_LOGPROB_ROWS = 4


def logprob_rows(value: int | str, reference: bool | str, kept: int | None = None) -> int:
    """extract.logprob_rows as a count: `auto` is SCALABLE_LOGPROB_ROWS under the scalable reference and 0 under the
    others (the full reference reads none), but at least `kept`, what the results folder's finished shards were made
    with (made_by.kept_logprob_rows): a shard holding more rows than asked is right, and redoing it is not."""
    if value != "auto":
        return int(value)
    return max(SCALABLE_LOGPROB_ROWS if reference_mode(reference) == "scalable" else 0, kept or 0)


def schema_default(section: str, key: str) -> Any:
    """The schema's default of `section`.`key` (a copy: callers may change it)."""
    return copy.deepcopy(load_schema()["properties"][section]["properties"][key]["default"])


def section_defaults(section: str, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`values` for config section `section`, checked and completed with the schema's defaults."""
    import jsonschema

    instance = {section: copy.deepcopy(dict(values or {}))}
    validator = _with_defaults(jsonschema.Draft202012Validator)(load_schema())
    errors = [e for e in validator.iter_errors(instance) if list(e.absolute_path)[:1] == [section]]
    if errors:
        raise ConfigError(_one_line(sorted(errors, key=lambda e: list(e.absolute_path))[0]))
    if section == "extract":  # as validate_config gives it: a count, under the default validate.reference
        instance[section]["logprob_rows"] = logprob_rows(
            instance[section]["logprob_rows"], schema_default("validate", "reference")
        )
    return instance[section]


def _with_defaults(validator_class):
    """A validator that fills `default`s into missing keys as it validates (jsonschema FAQ recipe)."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    import jsonschema

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


def _one_line(error) -> str:
    key = ".".join(str(p) for p in error.absolute_path) or "<top level>"
    sub = error.schema
    if error.validator == "enum":
        return f"config error: {key} = {error.instance!r} is not allowed; choose one of {sub['enum']}"
    if error.validator == "additionalProperties":
        allowed = sorted(sub.get("properties", {}))
        extra = [k for k in error.instance if k not in allowed] if isinstance(error.instance, dict) else []
        near = difflib.get_close_matches(str(extra[0]), allowed, n=1) if extra else []
        if near:  # a typo: the key the user meant says more than the whole list
            where = f"{key}.{extra[0]}" if error.absolute_path else str(extra[0])
            return f"config error: {where}: unknown key; did you mean {near[0]!r}? (allowed keys are {allowed})"
        return f"config error: {key}: {error.message}; allowed keys are {allowed}"
    if error.validator == "required":
        missing = next((m for m in sub.get("required", []) if m not in error.instance), None)
        where = f"{key}.{missing}" if error.absolute_path else str(missing)
        desc = sub.get("properties", {}).get(missing, {}).get("description", "")
        return f"config error: {where} is required and missing" + (f" ({desc.rstrip('.')})" if desc else "")
    if error.validator in ("oneOf", "anyOf"):  # jsonschema's "not valid under any of the given schemas" names none
        choices = " or ".join(_alternative(s) for s in sub[error.validator])
        desc = f" ({sub['description']})" if "description" in sub else ""
        return f"config error: {key} = {error.instance!r} is not allowed; choose {choices}{desc}"
    if error.validator in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems"):
        return f"config error: {key} = {error.instance!r}: {error.message}"
    desc = f" ({sub['description']})" if "description" in sub else ""
    return f"config error: {key} = {error.instance!r}: {error.message}{desc}"


def _alternative(schema: dict[str, Any]) -> str:
    """One branch of a oneOf/anyOf in words: its values ('auto'), or its type and bounds (an integer >= 0)."""
    if "enum" in schema:
        return " or ".join(repr(v) for v in schema["enum"])
    if "const" in schema:
        return repr(schema["const"])
    kind = schema.get("type", "value")
    kind = " or ".join(kind) if isinstance(kind, list) else str(kind)
    ops = (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
    bounds = " and ".join(f"{op} {schema[k]}" for k, op in ops if k in schema)
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}" + (f" {bounds}" if bounds else "")


_TRUE, _FALSE, _NULL = ("true", "yes", "on"), ("false", "no", "off"), ("null", "none", "~")


def coerce_scalar(value: str, types: list[str]) -> Any:
    """A command-line string read as the first schema type it fits; unchanged when none fits."""
    low = value.strip().lower()
    if "null" in types and low in _NULL:
        return None
    if "string" in types:
        return value
    if "boolean" in types and low in _TRUE + _FALSE:
        return low in _TRUE
    if "integer" in types and re.fullmatch(r"[-+]?\d+", value.strip()):
        return int(value)
    if "number" in types:
        try:
            return int(value) if re.fullmatch(r"[-+]?\d+", value.strip()) else float(value)
        except ValueError:
            pass
    return value


def _types(schema: dict[str, Any]) -> list[str]:
    kind = schema.get("type", [])
    return [kind] if isinstance(kind, str) else list(kind)


def _coerce_strings(instance: Any, schema: dict[str, Any]) -> Any:
    """Values given on the command line (`--config 'plan={tokens_per_s: 660}'`) reach the config as strings
    (Snakemake reads nested ones with YAML's BaseLoader): read them as the schema's type; return the value."""
    types = _types(schema)
    branches = schema.get("oneOf") or schema.get("anyOf") or []  # an integer or 'auto': '4' is read as 4
    if isinstance(instance, str) and not types and not any(instance in b.get("enum", ()) for b in branches):
        types = [t for b in branches if "enum" not in b for t in _types(b)]
    if isinstance(instance, str) and types:
        return coerce_scalar(instance, types)
    if isinstance(instance, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in instance:
                instance[key] = _coerce_strings(instance[key], sub)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        instance[:] = [_coerce_strings(item, schema["items"]) for item in instance]
    return instance


def _coerce_template_kwargs(config: dict[str, Any]) -> None:
    """tokenize.chat_template_kwargs with each string read as the null, boolean or number it spells, by the rule
    every other command-line value follows (coerce_scalar): the command line gives nested values as strings, and
    a template reads the string "false" as true."""

    def coerce(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: coerce(v) for k, v in value.items()}
        if isinstance(value, list):
            return [coerce(v) for v in value]
        return coerce_scalar(value, ["null", "boolean", "number"]) if isinstance(value, str) else value

    tokenize = config.get("tokenize")
    if isinstance(tokenize, dict) and isinstance(tokenize.get("chat_template_kwargs"), dict):
        tokenize["chat_template_kwargs"] = coerce(tokenize["chat_template_kwargs"])


def check_schema(config: dict[str, Any]) -> dict[str, Any]:
    """`config` checked against the schema in place, command-line strings read as their types and the defaults
    filled in; return it, or raise ConfigError on the first error."""
    import jsonschema

    schema = copy.deepcopy(load_schema())  # the validator fills defaults into `config`: none may be shared
    _coerce_strings(config, schema)
    _coerce_template_kwargs(config)
    validator = _with_defaults(jsonschema.Draft202012Validator)(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError(_one_line(errors[0]))
    return config


def reference_mode(value: bool | str) -> str:
    """validate.reference as one of full | scalable | off (true and false are full and off)."""
    return {True: "full", False: "off"}.get(value, value) if isinstance(value, bool) else str(value)
