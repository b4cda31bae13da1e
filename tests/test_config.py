import json

import pytest

from eagle3prep.config import ConfigError, validate_config
from eagle3prep.run.parse import (
    check_model,
    check_targets_after_configfile,
    check_tokenizer,
    cli_configfiles,
    config_source_line,
    config_sources,
    demo_config_error,
)
from eagle3prep.settings import Settings


def base(**over):
    return {"data": {"sources": ["a.jsonl"]}, "model": {"path": "m"}, **over}


def test_defaults_are_filled_in():
    c = validate_config(base())
    assert c["extract"]["backend"] == "hf"
    assert c["layers"] == {"ids": None, "convention": "input_of_layer", "drafts": []}
    assert c["tokenize"]["num_shards"] == 1 and c["export"]["speculators"] is False


def test_command_line_strings_are_coerced_to_the_schema_type():
    # What `snakemake --config 'export={speculators: true}' 'tokenize={num_shards: 3}'` hands over.
    c = validate_config(base(export={"speculators": "true"}, tokenize={"num_shards": "3"}))
    assert c["export"]["speculators"] is True and c["tokenize"]["num_shards"] == 3
    # a key that is an integer or 'auto' (`--config 'extract={logprob_rows: 2}' 'validate={sample_rows: auto}'`)
    c = validate_config(base(extract={"logprob_rows": "2"}, validate={"sample_rows": "auto"}))
    assert c["extract"]["logprob_rows"] == 2 and c["validate"]["sample_rows"] == "auto"
    assert validate_config(base(validate={"sample_rows": "7"}))["validate"]["sample_rows"] == 7
    with pytest.raises(ConfigError, match=r"extract\.logprob_rows = 'many' is not allowed; choose an integer >= 0"):
        validate_config(base(extract={"logprob_rows": "many"}))


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


def model_folder(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_layer_ids_are_checked_against_the_text_config_at_parse_time(tmp_path):
    # A multimodal wrapper (Kimi-K2.5): N lives in text_config. Was found only inside each extract job.
    path = model_folder(
        tmp_path, {"model_type": "qwen2_5_vl", "text_config": {"num_hidden_layers": 61}, "vision_config": {}}
    )
    assert check_model(Settings.validated(base(model={"path": path}, layers={"ids": [2, 30, 58, 61]}))) == []
    with pytest.raises(ConfigError, match=r"^config error: layers.ids = \[2, 4, 99\] has ids \[99\] outside 0..61"):
        check_model(Settings.validated(base(model={"path": path}, layers={"ids": [2, 4, 99]})))


KIMI = {
    "model_type": "kimi_k25",
    "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": 61},
    "vision_config": {},
}


def test_a_target_whose_images_tokenize_cannot_expand_is_named_at_parse_time(tmp_path):
    # Kimi-K2.5's vision tower (MoonViT, remote code): tokenize cannot expand its images (issue #28 item 5).
    (tmp_path / "kimi").mkdir(), (tmp_path / "text").mkdir()
    kimi = model_folder(tmp_path / "kimi", KIMI)
    (note,) = check_model(Settings.validated(base(model={"path": kimi}, layers={"ids": [2, 30, 58, 61]})))
    assert note.startswith("model.path: tokenizing images for model_type 'kimi_k25' is not implemented")
    assert "quarantined (images_unsupported_by_target)" in note and "\n" not in note
    # data.image_root says the run means images: refused before any job, in one line.
    images = {"sources": ["x.jsonl"], "image_root": "imgs"}
    with pytest.raises(ConfigError, match=r"^config error: data.image_root = 'imgs' is set, but tokenizing images"):
        check_model(Settings.validated(base(model={"path": kimi}, layers={"ids": [2, 30, 58, 61]}, data=images)))
    text = model_folder(tmp_path / "text", {"num_hidden_layers": 8})
    assert check_model(Settings.validated(base(model={"path": text}, layers={"ids": [2, 4, 8]}))) == []
    with pytest.raises(ConfigError, match=r"is set, but the target \(None\) has no vision tower") as e:
        check_model(Settings.validated(base(model={"path": text}, layers={"ids": [2, 4, 8]}, data=images)))
    assert "\n" not in str(e.value)


def test_a_missing_model_folder_is_an_error_unless_the_demo_builds_it(tmp_path):
    with pytest.raises(ConfigError, match="model.path = '.*nope': no such folder"):
        check_model(Settings.validated(base(model={"path": str(tmp_path / "nope")})))
    assert check_model(Settings.validated(base(model={"path": str(tmp_path / "nope"), "build_demo": True}))) == []
    with pytest.raises(ConfigError, match="has no config.json"):
        check_model(Settings.validated(base(model={"path": str(tmp_path)})))


def test_default_layer_ids_that_collapse_on_a_small_model_are_named_in_one_line(tmp_path):
    path = model_folder(tmp_path, {"num_hidden_layers": 6})
    notes = check_model(Settings.validated(base(model={"path": path})))
    assert len(notes) == 1 and "\n" not in notes[0]
    assert "the default [2, N//2, N-3, N] is [2, 3, 3, 6] for this N = 6" in notes[0]
    assert "3 distinct ids [2, 3, 6] are captured, not 4" in notes[0]
    assert (
        check_model(Settings.validated(base(model={"path": model_folder(tmp_path, {"num_hidden_layers": 32})}))) == []
    )


def test_layer_ids_that_cannot_feed_speculators_are_refused_at_parse_time(tmp_path):
    # Was found only by the export, after every extract and validate job (issue #27 item 3).
    path = model_folder(tmp_path, {"num_hidden_layers": 8})
    ok = base(model={"path": path}, layers={"ids": [2, 4, 5]})
    assert check_model(Settings.validated(ok)) == []
    bad = base(model={"path": path}, layers={"ids": [2, 4, 5]}, export={"speculators": True})
    with pytest.raises(ConfigError, match=r"^config error: layer ids \[2, 4, 5\] cannot feed speculators"):
        check_model(Settings.validated(bad))


# ---- issue #27 ----------------------------------------------------------------------------------------------


def test_layer_id_errors_speak_the_users_convention(tmp_path):
    """The Kimi example's ids on a small model said `layers.ids = [3, 31, 59, 61] has ids [31, 59, 61] outside
    0..8`: ids converted to ours, which the user never wrote."""
    path = model_folder(tmp_path, {"num_hidden_layers": 8})
    kimi = {"ids": [2, 30, 58, 60], "convention": "output_of_layer"}
    with pytest.raises(ConfigError) as e:
        check_model(Settings.validated(base(model={"path": path}, layers=kimi)))
    assert str(e.value).startswith(
        "config error: layers.ids = [2, 30, 58, 60] (output_of_layer) has ids [30, 58, 60] outside -1..7 "
        "(the model has N = 8 decoder layers; id 7 is the output of the last decoder layer, before the final norm)"
    )
    short = base(model={"path": path}, layers={"ids": [1, 3, 4], "convention": "output_of_layer"})
    with pytest.raises(ConfigError, match=r"^config error: layer ids \[1, 3, 4\] \(output_of_layer\) cannot feed "):
        check_model(Settings.validated(short | {"export": {"speculators": True}}))
    with pytest.raises(ConfigError, match=r"final state \(id 7\) after at least one auxiliary layer; add 7 to"):
        check_model(Settings.validated(short | {"export": {"speculators": True}}))


def test_a_key_typo_names_the_nearest_allowed_key():
    with pytest.raises(ConfigError) as e:
        validate_config(base(extract={"bakend": "hf"}))
    assert str(e.value).startswith("config error: extract.bakend: unknown key; did you mean 'backend'?")
    with pytest.raises(ConfigError, match=r"^config error: tokenise: unknown key; did you mean 'tokenize'\?"):
        validate_config(base(tokenise={"num_shards": 2}))


def test_a_missing_required_key_is_named():
    """A config file without data.sources ran on the demo's files; now it is a config error naming the key."""
    with pytest.raises(ConfigError, match=r"^config error: data.sources is required and missing \(Raw conversation"):
        validate_config({"model": {"path": "m"}})
    with pytest.raises(ConfigError, match=r"^config error: model.path is required and missing"):
        validate_config({"data": {"sources": ["a.jsonl"]}, "model": {}})


def test_a_missing_source_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^config error: data.sources: 'a.jsonl' does not exist"):
        config_sources(Settings.validated(base()))
    (tmp_path / "a.jsonl").write_text("{}\n")
    assert config_sources(Settings.validated(base())) == ["a.jsonl"]


def test_the_config_in_force_is_named_in_one_line(tmp_path):
    mine = str(tmp_path / "config" / "my-run.yaml")
    line = config_source_line([mine], overrides=True, cwd=tmp_path)
    assert line.startswith("config config/my-run.yaml over the schema's defaults")
    assert "the demo's config/config.yaml is not read" in line and "+ --config" in line
    assert line.endswith(f"results in {tmp_path.resolve() / 'results'}")
    assert config_source_line([], overrides=False, cwd=tmp_path).startswith("config config/config.yaml (the demo's")
    assert demo_config_error(tmp_path).startswith("config error: no --configfile given and no config/config.yaml")


def test_snakemake_still_exposes_the_command_line_config_files():
    """The Snakefile reads Workflow.overwrite_configfiles (the --configfile files) to tell them from the demo's
    config; a Snakemake without it must stop the parse in one line, not merge the demo's values under the user's."""
    import snakemake.api  # noqa: F401 (snakemake.workflow is importable only after it: a circular import)
    from snakemake.workflow import Workflow

    assert isinstance(Workflow.overwrite_configfiles, property)

    class Given:
        overwrite_configfiles = ["/run/a.yaml"]

    assert cli_configfiles(Given()) == ["/run/a.yaml"]

    class Renamed:
        config_settings = object()

    with pytest.raises(ConfigError, match=r"^error: this Snakemake \(.*\) has no Workflow.overwrite_configfiles"):
        cli_configfiles(Renamed())


def test_a_target_read_as_a_config_file_says_how_to_write_the_command(tmp_path):
    """`snakemake --configfile config/my-run.yaml plan` with a file `plan` in the working directory: Snakemake reads
    it as a second config file; the check turns that into one line."""
    files = [str(tmp_path / "config/my-run.yaml"), str(tmp_path / "plan")]
    with pytest.raises(ConfigError) as e:
        check_targets_after_configfile(files, tmp_path)
    assert str(e.value) == (
        "config error: `plan` after --configfile was read as a config file (--configfile takes several); "
        "put the target first: snakemake plan --configfile config/my-run.yaml"
    )
    check_targets_after_configfile(files[:1], tmp_path)  # one config file: nothing to say


def test_a_model_folder_without_a_loadable_tokenizer_is_refused_at_parse_time(tmp_path, demo_model_dir):
    """It passed `-n`; tokenize then died with a 28-line traceback ending `Couldn't instantiate the backend
    tokenizer`."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(demo_model_dir, model)
    config, stamp = Settings.validated(base(model={"path": str(model)})), tmp_path / "stamp"
    check_tokenizer(config, stamp)  # the demo's tokenizer passes, and the pass is recorded
    assert stamp.is_file()
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    with pytest.raises(ConfigError) as e:  # other files than the recorded pass: checked again
        check_tokenizer(config, stamp)
    assert str(e.value).startswith(f"config error: model.path = {model}: the folder has no tokenizer files (")
    assert "\n" not in str(e.value)
    (model / "tokenizer.json").write_text("{}")  # a tokenizer file that does not load: transformers' reason
    with pytest.raises(ConfigError) as e:
        check_tokenizer(config, stamp)
    assert str(e.value).startswith(f"config error: model.path = '{model}' has no tokenizer that loads (")
    assert "\n" not in str(e.value)


def test_a_chat_template_without_a_loss_mask_is_refused_at_parse_time(tmp_path, demo_model_dir):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(demo_model_dir, model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    cfg = base(model={"path": str(model)}, tokenize={"template_fallback": False})
    with pytest.raises(ConfigError, match=r"^config error: model.path = .*no \{% generation %\} markers"):
        check_tokenizer(Settings.validated(cfg), stamp=None)


def test_a_model_folder_without_hidden_size_or_weights_is_refused_at_parse_time(tmp_path, demo_model_dir):
    """Issue #27 item 3: both passed `-n` and stopped the first extract job, after prepare and tokenize."""
    import shutil

    from eagle3prep.run.parse import check_model_files

    model = tmp_path / "model"
    shutil.copytree(demo_model_dir, model)
    config = Settings.validated(base(model={"path": str(model)}))
    check_model_files(config)  # the demo's folder passes
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ConfigError, match=r"^config error: model.path = '.*model' holds no weight files \(\*\.safe"):
        check_model_files(config)
    (model / "pytorch_model.bin").write_bytes(b"")
    check_model_files(config)
    facts = json.loads((model / "config.json").read_text())
    del facts["hidden_size"]
    (model / "config.json").write_text(json.dumps(facts))
    with pytest.raises(ConfigError, match="config.json has no hidden_size"):
        check_model_files(config)
    check_model_files(Settings.validated(base(model={"path": str(tmp_path / "nope"), "build_demo": True})))


def test_extract_engine_args_that_still_capture_every_row_pass():
    from eagle3prep.config.engine import check_extract_engine_args

    check_extract_engine_args({"max_model_len": 257, "data_parallel_size": 1, "enable_prefix_caching": "false"}, 256)
    check_extract_engine_args({"max_model_len": "4096", "enforce_eager": True}, 256)


@pytest.mark.parametrize("value", ["all", -1])
def test_a_value_no_alternative_allows_lists_the_allowed_values(value):
    """validate.sample_rows: all said "'all' is not valid under any of the given schemas", naming no value."""
    with pytest.raises(ConfigError) as e:
        validate_config(base(validate={"sample_rows": value}))
    assert str(e.value).startswith(
        f"config error: validate.sample_rows = {value!r} is not allowed; choose an integer >= 0 or 'auto'"
    )
    assert "not valid under any of the given schemas" not in str(e.value) and "\n" not in str(e.value)
