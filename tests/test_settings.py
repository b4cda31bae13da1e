"""The typed settings (settings.py): built once from the validated config, defaults only from the schema."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from eagle3prep.config import SCHEMA, ConfigError, logprob_rows, validate_config
from eagle3prep.settings import (
    _FIELD_TYPES,
    SECTIONS,
    TOP_LEVEL,
    UNUSED,
    ExtractContent,
    ExtractSettings,
    ExtractSpeed,
    LayersSettings,
    RegenerateContent,
    RegenerateSettings,
    RegenerateSpeed,
    RegenerateWorkflow,
    Settings,
)

REPO = Path(__file__).resolve().parents[1]
EXTRACT_SCHEMA = yaml.safe_load(SCHEMA.read_text())["properties"]["extract"]["properties"]
REGENERATE_SCHEMA = yaml.safe_load(SCHEMA.read_text())["properties"]["regenerate"]["properties"]


def base(**over):
    return {"data": {"sources": ["a.jsonl"]}, "model": {"path": "m"}, **over}


def test_every_default_comes_from_the_schema():
    s = ExtractSettings.defaults()
    values = {**dataclasses.asdict(s.content), **dataclasses.asdict(s.speed)}
    schema = {k: EXTRACT_SCHEMA[k]["default"] for k in values}
    assert values == {**schema, "logprob_rows": logprob_rows(schema["logprob_rows"], True)}  # auto as a count
    assert s == ExtractSettings.from_config(validate_config(base()))  # the workflow's path gives the same


@pytest.mark.parametrize(
    ("reference", "kept", "rows"),
    [(True, None, 0), ("full", None, 0), ("off", None, 0), ("scalable", None, 4), (True, 4, 4), ("scalable", 0, 4)],
)
def test_logprob_rows_auto_asks_what_the_reference_reads_and_never_below_the_finished_shards(reference, kept, rows):
    """The full reference reads no prompt logprobs; finished shards made with more keep their count (a shard
    with more logprob rows than asked is right), so no shard is redone by the default's change."""
    config = validate_config(base(validate={"reference": reference}), kept)
    assert config["extract"]["logprob_rows"] == rows
    assert list(config["extract"]).index("logprob_rows") == list(EXTRACT_SCHEMA).index("logprob_rows")  # params' order
    assert validate_config(base(extract={"logprob_rows": 2}), 4)["extract"]["logprob_rows"] == 2  # a count stays


def test_the_demo_config_sets_batch_tokens_and_the_settings_read_it():
    config = validate_config(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
    assert ExtractSettings.from_config(config).speed.batch_tokens == 4096
    assert ExtractSettings.defaults(batch_tokens=512).speed.batch_tokens == 512


@pytest.mark.parametrize("path", sorted((REPO / "config" / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_the_example_configs_build_their_settings(path):
    config = validate_config(yaml.safe_load(path.read_text()))
    settings = ExtractSettings.from_config(config)
    assert settings.content.backend == config["extract"]["backend"]
    assert settings.speed.gpu_memory_utilization == config["extract"]["gpu_memory_utilization"]
    regenerate = RegenerateSettings.from_config(config)
    assert regenerate.content.sampling.max_tokens == config["regenerate"]["sampling"]["max_tokens"]
    assert regenerate.workflow.enabled == config["regenerate"]["enabled"]


def test_settings_are_frozen():
    s = ExtractSettings.defaults()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.speed.batch_tokens = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.content = s.content  # type: ignore[misc]


def test_every_extract_key_is_content_speed_or_unused_exactly_once():
    content = {f.name for f in dataclasses.fields(ExtractContent)}
    speed = {f.name for f in dataclasses.fields(ExtractSpeed)}
    assert not content & speed and not (content | speed) & UNUSED["extract"]
    assert content | speed | UNUSED["extract"] == set(EXTRACT_SCHEMA)


def test_speed_knobs_are_not_params_and_the_params_keep_the_users_order():
    config = validate_config(base(extract={"dtype": "float16", "batch_tokens": 64, "backend": "hf"}))
    params = ExtractSettings.params(config)
    assert not {f.name for f in dataclasses.fields(ExtractSpeed)} & set(params)
    assert "staging_dir" not in params
    assert list(params)[:2] == ["dtype", "backend"]  # Snakemake compares the params' repr: order counts
    later = validate_config(base(extract={"dtype": "float16", "batch_tokens": 8, "gpu_memory_utilization": 0.5}))
    assert ExtractSettings.params(later) == params  # a speed knob changed: no shard is re-queued


def test_storage_is_a_param_only_away_from_its_default():
    """A run made before extract.storage existed keeps its shards (Snakemake compares the params whole)."""
    assert "storage" not in ExtractSettings.params(validate_config(base()))
    fp8 = validate_config(base(extract={"storage": "fp8_e4m3"}))
    assert ExtractSettings.params(fp8)["storage"] == "fp8_e4m3"
    assert ExtractSettings.from_config(validate_config(base())).content.storage == "model_dtype"


def test_a_bad_value_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as e:
        ExtractSettings.defaults(capture_path="fast")
    assert "extract.capture_path = 'fast' is not allowed" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="did you mean 'batch_tokens'"):
        ExtractSettings.defaults(batch_token=8)


def test_an_unvalidated_section_is_refused():
    with pytest.raises(KeyError, match="validate_config"):
        ExtractSettings.from_config({"extract": {"backend": "hf"}})


# ---- regenerate ---------------------------------------------------------------------------------------------


def test_every_regenerate_default_comes_from_the_schema():
    s = RegenerateSettings.defaults()
    values = {**dataclasses.asdict(s.content), **dataclasses.asdict(s.speed), **dataclasses.asdict(s.workflow)}
    sampling = REGENERATE_SCHEMA["sampling"]["properties"]
    assert values.pop("sampling") == {k: sampling[k]["default"] for k in sampling}
    assert values == {k: REGENERATE_SCHEMA[k]["default"] for k in values}
    assert s == RegenerateSettings.from_config(validate_config(base()))  # the workflow's path gives the same


def test_every_regenerate_key_is_content_speed_or_workflow_exactly_once():
    parts = [
        {f.name for f in dataclasses.fields(cls)} for cls in (RegenerateContent, RegenerateSpeed, RegenerateWorkflow)
    ]
    assert sum(map(len, parts)) == len(set().union(*parts)) and set().union(*parts) == set(REGENERATE_SCHEMA)


def test_regenerate_params_are_the_content_keys_in_the_users_order():
    """The keys the regenerate rule's params held before the settings were typed (a finished shard is not
    re-queued), in the order the user wrote them; speed knobs and DAG keys are left out by structure."""
    section = {"sampling": {"seed": 5, "temperature": 0.7}, "enabled": True, "num_shards": 3, "turns": "last",
               "gpu_memory_utilization": 0.5, "max_num_seqs": 64, "threads": 4, "review_samples": 9}  # fmt: skip
    params = RegenerateSettings.params(validate_config(base(regenerate=section)))
    assert list(params) == ["sampling", "turns", "thinking", "thinking_markers", "on_length", "on_empty",
                            "max_model_len", "dtype", "tp_size", "enforce_eager", "quantization", "engine_args"]  # fmt: skip
    assert params["sampling"] == {"seed": 5, "temperature": 0.7, "top_p": 1, "top_k": None, "max_tokens": 1024}
    faster = {**section, "gpu_memory_utilization": 0.8, "max_num_seqs": 8, "max_in_flight": 16, "num_shards": 1}
    assert RegenerateSettings.params(validate_config(base(regenerate=faster))) == params  # no shard re-queued
    kwargs = validate_config(base(regenerate=section, tokenize={"chat_template_kwargs": {"enable_thinking": False}}))
    assert RegenerateSettings.params(kwargs) == {**params, "chat_template_kwargs": {"enable_thinking": False}}


def test_a_bad_regenerate_value_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"regenerate.sampling.top_p = 0: 0 is less than or equal"):
        RegenerateSettings.defaults(sampling={"top_p": 0})
    with pytest.raises(ConfigError, match="did you mean 'max_in_flight'"):
        RegenerateSettings.defaults(max_inflight=8)


def leaf_fields(cls) -> list[str]:
    """A section class's config keys: its fields, a part of the settings (content, speed, workflow) by its own."""
    names = []
    for f in dataclasses.fields(cls):
        part = _FIELD_TYPES.get(cls, {}).get(f.name)
        names += leaf_fields(part) if part else [f.name]
    return names


def test_every_schema_section_is_one_typed_frozen_setting_with_exactly_its_keys():
    """Issue 43: the code reads typed settings, never config["section"]["key"]; a key added to the schema without
    a field (or a field without a key) fails here."""
    schema = yaml.safe_load(SCHEMA.read_text())["properties"]
    by_section = {cls.SECTION: cls for cls in SECTIONS}
    assert set(by_section) | set(TOP_LEVEL) == set(schema)
    assert [f.name for f in dataclasses.fields(Settings)] == [cls.SECTION for cls in SECTIONS] + list(TOP_LEVEL)
    for name, cls in by_section.items():
        keys = leaf_fields(cls) + sorted(UNUSED.get(name, ()))
        assert sorted(keys) == sorted(schema[name]["properties"]), name
        assert len(keys) == len(set(keys)), name  # each key read once
        assert cls.__dataclass_params__.frozen, name
    for name in TOP_LEVEL:
        assert "properties" not in schema[name], name


def test_the_whole_config_becomes_settings_once_and_each_part_reads_its_section():
    config = base(layers={"ids": [2, 4], "convention": "output_of_layer"}, heal={"keep_failed": True})
    settings = Settings.validated(config)
    assert config["plan"] == {"tokens_per_s": None, "engine_start_s": 60}  # validated in place, defaults filled
    assert settings.layers == LayersSettings(ids=[2, 4], convention="output_of_layer")
    assert (settings.heal.keep_failed, settings.replace_results, settings.data.sources) == (True, False, ["a.jsonl"])
    assert settings.extract == ExtractSettings.from_config(config)
    assert settings.validate.reference_mode == "full"  # reference: true
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.model.path = "other"  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"^config error: heal.keep_failed = 'maybe'"):
        Settings.validated(base(heal={"keep_failed": "maybe"}))
