import json

import pytest

from eagle3prep.config import (
    SPEED_KEYS,
    ConfigError,
    check_model,
    extract_data_params,
    extract_options,
    validate_config,
)


def base(**over):
    return {"data": {"sources": ["a.jsonl"]}, "model": {"path": "m"}, **over}


def test_defaults_are_filled_in():
    c = validate_config(base())
    assert c["extract"]["backend"] == "hf" and c["layers"] == {"ids": None, "convention": "input_of_layer"}
    assert c["tokenize"]["num_shards"] == 1 and c["export"]["speculators"] is False


def test_command_line_strings_are_coerced_to_the_schema_type():
    # What `snakemake --config 'export={speculators: true}' 'tokenize={num_shards: 3}'` hands over.
    c = validate_config(base(export={"speculators": "true"}, tokenize={"num_shards": "3"}))
    assert c["export"]["speculators"] is True and c["tokenize"]["num_shards"] == 3


def test_command_line_numbers_nulls_and_lists_are_accepted():
    # `--config 'plan={tokens_per_s: 660}'` failed with "'660' is not of type 'number'".
    c = validate_config(
        base(
            plan={"tokens_per_s": "660", "engine_start_s": "12.5"},
            layers={"ids": ["2", "4", "8"]},
            extract={"quantization": "null", "enforce_eager": "yes", "gpu_memory_utilization": "0.5"},
        )
    )
    assert c["plan"] == {"tokens_per_s": 660, "engine_start_s": 12.5}
    assert c["layers"]["ids"] == [2, 4, 8]
    assert c["extract"]["quantization"] is None and c["extract"]["enforce_eager"] is True
    assert c["extract"]["gpu_memory_utilization"] == 0.5
    assert validate_config(base(plan={"tokens_per_s": "null"}))["plan"]["tokens_per_s"] is None


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"extract": {"dtype": "fp8"}}, "extract.dtype = 'fp8' is not allowed; choose one of"),
        ({"tokenize": {"num_shards": 0}}, "tokenize.num_shards = 0"),
        ({"layers": {"convention": "sglang"}}, "layers.convention = 'sglang' is not allowed"),
        ({"extract": {"bakend": "hf"}}, "allowed keys are"),
    ],
)
def test_errors_are_one_line_naming_the_key(over, message):
    with pytest.raises(ConfigError) as e:
        validate_config(base(**over))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_speed_knobs_are_not_params_and_come_back_from_the_config():
    extract = validate_config(base())["extract"]
    params = extract_data_params(extract)
    assert not SPEED_KEYS & set(params)
    assert {"backend", "dtype", "tp_size", "capture_path", "quantization", "engine_args"} <= set(params)
    now = {**extract, "gpu_memory_utilization": 0.5, "dtype": "float16"}  # the config at run time
    options = extract_options(params, now)
    assert options["gpu_memory_utilization"] == 0.5  # a speed knob: the config as it is now
    assert options["dtype"] == extract["dtype"]  # a data key: what the params (the rerun trigger) hold
    assert set(options) == set(extract)


def model_folder(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_layer_ids_are_checked_against_the_text_config_at_parse_time(tmp_path):
    # A multimodal wrapper (Kimi-K2.5): N lives in text_config. Was found only inside each extract job.
    path = model_folder(tmp_path, {"text_config": {"num_hidden_layers": 61}, "vision_config": {}})
    assert check_model(validate_config(base(model={"path": path}, layers={"ids": [2, 30, 58, 61]}))) == []
    with pytest.raises(ConfigError, match=r"^config error: layers.ids = \[2, 4, 99\] has ids \[99\] outside 0..61"):
        check_model(validate_config(base(model={"path": path}, layers={"ids": [2, 4, 99]})))


def test_a_missing_model_folder_is_an_error_unless_the_demo_builds_it(tmp_path):
    with pytest.raises(ConfigError, match="model.path = '.*nope': no such folder"):
        check_model(validate_config(base(model={"path": str(tmp_path / "nope")})))
    assert check_model(validate_config(base(model={"path": str(tmp_path / "nope"), "build_demo": True}))) == []
    with pytest.raises(ConfigError, match="has no config.json"):
        check_model(validate_config(base(model={"path": str(tmp_path)})))


def test_default_layer_ids_that_collapse_on_a_small_model_are_named_in_one_line(tmp_path):
    path = model_folder(tmp_path, {"num_hidden_layers": 6})
    notes = check_model(validate_config(base(model={"path": path})))
    assert len(notes) == 1 and "\n" not in notes[0]
    assert "the default [2, N//2, N-3, N] is [2, 3, 3, 6] for this N = 6" in notes[0]
    assert "3 distinct ids [2, 3, 6] are captured, not 4" in notes[0]
    assert check_model(validate_config(base(model={"path": model_folder(tmp_path, {"num_hidden_layers": 32})}))) == []


def test_layer_ids_that_cannot_feed_speculators_are_refused_at_parse_time(tmp_path):
    # Was found only by the export, after every extract and validate job (issue #27 item 3).
    path = model_folder(tmp_path, {"num_hidden_layers": 8})
    ok = base(model={"path": path}, layers={"ids": [2, 4, 5]})
    assert check_model(validate_config(ok)) == []
    bad = base(model={"path": path}, layers={"ids": [2, 4, 5]}, export={"speculators": True})
    with pytest.raises(ConfigError, match=r"^config error: layer ids \[2, 4, 5\] cannot feed speculators"):
        check_model(validate_config(bad))
