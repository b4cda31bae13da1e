import pytest

from eagle3prep.config import SPEED_KEYS, ConfigError, extract_data_params, extract_options, validate_config


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
