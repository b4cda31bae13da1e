"""Config loading: JSON-schema validation with defaults, one-line errors, layer-id conversion."""

from __future__ import annotations

import copy
import difflib
import functools
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .errors import UserError
from .layers import convert_layer_ids, resolve_layer_ids
from .model_facts import ModelFacts

SCHEMA = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


class ConfigError(UserError, ValueError):
    """A config value is wrong; the message names the key, the value and what is allowed."""


@functools.cache
def load_schema() -> dict[str, Any]:
    """config/schema.yaml, read once (callers must not change it: schema_default hands out copies)."""
    return yaml.safe_load(SCHEMA.read_text(encoding="utf-8"))


def schema_default(section: str, key: str) -> Any:
    """config/schema.yaml's default of `section`.`key` (a copy: callers may change it)."""
    return copy.deepcopy(load_schema()["properties"][section]["properties"][key]["default"])


def section_defaults(section: str, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`values` for config section `section`, checked and completed with the schema's defaults."""
    import jsonschema

    instance = {section: copy.deepcopy(dict(values or {}))}
    validator = _with_defaults(jsonschema.Draft202012Validator)(load_schema())
    errors = [e for e in validator.iter_errors(instance) if list(e.absolute_path)[:1] == [section]]
    if errors:
        raise ConfigError(_one_line(sorted(errors, key=lambda e: list(e.absolute_path))[0]))
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


def _coerce_scalar(value: str, types: list[str]) -> Any:
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


def _coerce_strings(instance: Any, schema: dict[str, Any]) -> Any:
    """Values given on the command line (`--config 'plan={tokens_per_s: 660}'`) reach the config as strings
    (Snakemake reads nested ones with YAML's BaseLoader): read them as the schema's type; return the value."""
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else types
    if isinstance(instance, str) and types:
        return _coerce_scalar(instance, types)
    if isinstance(instance, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in instance:
                instance[key] = _coerce_strings(instance[key], sub)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        instance[:] = [_coerce_strings(item, schema["items"]) for item in instance]
    return instance


def _coerce_template_kwargs(config: dict[str, Any]) -> None:
    """tokenize.chat_template_kwargs with each string read as the null, boolean or number it spells, by the rule
    every other command-line value follows (_coerce_scalar): the command line gives nested values as strings, and
    a template reads the string "false" as true."""

    def coerce(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: coerce(v) for k, v in value.items()}
        if isinstance(value, list):
            return [coerce(v) for v in value]
        return _coerce_scalar(value, ["null", "boolean", "number"]) if isinstance(value, str) else value

    tokenize = config.get("tokenize")
    if isinstance(tokenize, dict) and isinstance(tokenize.get("chat_template_kwargs"), dict):
        tokenize["chat_template_kwargs"] = coerce(tokenize["chat_template_kwargs"])


# What the encoder hands the chat template itself (the messages, tools, the generation prompt, the special
# tokens, transformers' template helpers) and apply_chat_template's own arguments: a chat_template_kwargs key
# among them would override the encoder's value or change how the template is called.
TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "return_assistant_tokens_mask", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "tokenizer_kwargs", "raise_exception", "strftime_now"}
)  # fmt: skip
SPECIAL_TOKEN_NAMES = frozenset(
    {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
     "additional_special_tokens"}
)  # fmt: skip


def template_kwarg_clash(key: str, special_tokens: Collection[str] = ()) -> str | None:
    """What the encoder passes the chat template under the name `key` (then it cannot be a
    tokenize.chat_template_kwargs key), or None. `special_tokens`: the tokenizer's own, beyond the usual names."""
    if key in TEMPLATE_ARGUMENTS:
        return "an apply_chat_template argument"
    if key in SPECIAL_TOKEN_NAMES or key in special_tokens:
        return "a special token of the tokenizer"
    return None


def template_kwargs_error(key: str, what: str) -> str:
    """The one line that refuses tokenize.chat_template_kwargs.`key`, `what` the encoder passes under it."""
    return (
        f"tokenize.chat_template_kwargs.{key}: the encoder passes {key} to the chat template itself ({what}); "
        "remove it (the mapping is for the template's own variables, such as enable_thinking)"
    )


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise ConfigError, naming the key, when tokenize.chat_template_kwargs holds a name the encoder sets."""
    for key in kwargs:
        what = template_kwarg_clash(key)
        if what:
            raise ConfigError(f"config error: {template_kwargs_error(key, what)}")


def validate_config(config: dict[str, Any], schema_path: str | Path = SCHEMA) -> dict[str, Any]:
    """Validate `config` in place (defaults filled in) and return it; raise ConfigError on the first error."""
    import jsonschema

    schema = yaml.safe_load(Path(schema_path).read_text(encoding="utf-8"))
    _coerce_strings(config, schema)
    _coerce_template_kwargs(config)
    validator = _with_defaults(jsonschema.Draft202012Validator)(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError(_one_line(errors[0]))
    check_template_kwargs(config["tokenize"]["chat_template_kwargs"])
    check_extract_engine_args(config["extract"]["engine_args"], config["tokenize"]["max_seq_len"])
    if config["layers"]["ids"] is not None:
        try:  # fails early on a bad convention; the range check needs the model (layer_ids below)
            convert_layer_ids(config["layers"]["ids"], config["layers"]["convention"])
        except ValueError as e:
            raise ConfigError(f"config error: {e}") from None
    return config


def check_extract_engine_args(engine_args: dict[str, Any], max_seq_len: int) -> None:
    """What extract.engine_args cannot set, refused at parse time: the vLLM engine would start, after the GPU
    job was queued, and capture missing or partial rows."""
    caching = engine_args.get("enable_prefix_caching")
    if _coerce_scalar(caching, ["boolean"]) if isinstance(caching, str) else caching:
        raise ConfigError(
            "config error: extract.engine_args.enable_prefix_caching must stay false: a prefix-cache hit skips the "
            "forward of the cached tokens, whose hidden states would then be missing"
        )
    dp = engine_args.get("data_parallel_size", 1)
    if str(dp).strip() not in ("1", "None"):  # each data-parallel rank serves its own requests
        raise ConfigError(
            f"config error: extract.engine_args.data_parallel_size = {dp}: a job captures with one engine of "
            "tp_size GPUs; to use more GPUs run more jobs at once (snakemake --resources gpus=N)"
        )
    limit = engine_args.get("max_model_len")
    if limit is not None and str(limit).strip().isdigit() and int(limit) <= max_seq_len:
        raise ConfigError(
            f"config error: extract.engine_args.max_model_len = {limit} must exceed tokenize.max_seq_len = "
            f"{max_seq_len} (a row and the one token the engine generates); leave it unset, extract sets it"
        )


def check_capture_path(backend: str, capture_path: str, model_path: str | Path) -> None:
    """extract.capture_path against the installed vLLM and the model's family, at parse time: a family no path of
    this vLLM takes (no SupportsEagle3 for the built-in path, no hooks from 0.34 on) is refused before any GPU job,
    in one line naming what can capture it (vllm/families.py). Where no vLLM is installed here, or vLLM
    cannot tell, the engine start decides."""
    if backend != "vllm" or not (Path(model_path) / "config.json").is_file():
        return
    archs = ModelFacts.read(model_path).architectures
    if not archs:
        return
    from .vllm import families

    asked = families.installed_support(archs[0])
    if asked is None:
        return
    version, supports = asked
    if line := families.refusal(version, archs[0], capture_path, supports):
        raise ConfigError(f"config error: {line}")


def model_layer_ids(model_path: str, ids: Sequence[int] | None, convention: str) -> list[int]:
    """layers.ids in `convention` resolved against the model's N, or a one-line ConfigError."""
    n = ModelFacts.read(model_path).num_hidden_layers
    try:
        return resolve_layer_ids(ids, convention, n)
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None


def model_max_positions(model_path: str | Path) -> int | None:
    """Longest row the model takes (ModelFacts.max_positions); None for a tokenizer-only folder."""
    if not (Path(model_path) / "config.json").is_file():
        return None
    return ModelFacts.read(model_path).max_positions


def check_max_seq_len(max_seq_len: int, model_path: str | Path) -> None:
    """Raise ConfigError when tokenize.max_seq_len is longer than the model can take."""
    limit = model_max_positions(model_path)
    if limit is not None and max_seq_len > limit:
        raise ConfigError(
            f"config error: tokenize.max_seq_len = {max_seq_len} is above the model's context of {limit} tokens "
            f"(max_position_embeddings in {Path(model_path) / 'config.json'}); set it to {limit} or less"
        )


def reference_mode(value: bool | str) -> str:
    """validate.reference as one of full | scalable | off (true and false are full and off)."""
    return {True: "full", False: "off"}.get(value, value) if isinstance(value, bool) else str(value)
