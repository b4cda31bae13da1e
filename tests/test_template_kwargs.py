"""tokenize.chat_template_kwargs: extra chat-template variables (Qwen3's enable_thinking), checked at config
validation and handed to every render as apply_chat_template's keyword arguments."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eagle3prep.config import ConfigError, validate_config
from eagle3prep.records import Conversation
from eagle3prep.regenerate import (
    PromptRenderer,
    RegenerateJobSettings,
    RegeneratePaths,
    ShardError,
    run_regenerate_job,
    split_conversations,
)
from eagle3prep.regenerate.merge import _check_same_settings
from eagle3prep.settings import RegenerateSettings, TokenizeSettings
from eagle3prep.tokenize import ChatEncoder, TokenizeError, tokenize_conversations

from testkit.regenerate import A1, U1, U2, FakeEngine, echo
from testkit.regenerate import conv as regen_conv


def base(**over):
    return {"data": {"sources": ["a.jsonl"]}, "model": {"path": "m"}, **over}


def test_the_default_is_empty_and_adds_no_rule_param():
    tokenize = validate_config(base())["tokenize"]
    assert tokenize["chat_template_kwargs"] == {}
    # Snakemake compares a rule's params as a whole: a new one at its default would re-queue old runs.
    assert TokenizeSettings.of(tokenize).template_kwargs_params() == {}
    assert TokenizeSettings.defaults(chat_template_kwargs={"enable_thinking": False}).template_kwargs_params() == {
        "chat_template_kwargs": {"enable_thinking": False}
    }


def test_command_line_strings_are_read_as_the_values_they_spell():
    # `--config 'tokenize={chat_template_kwargs: {enable_thinking: false}}'` hands over the string "false",
    # which a template reads as true.
    kwargs = {"enable_thinking": "false", "budget": "512", "t": "0.5", "none": "null", "name": "low", "l": ["true"]}
    got = validate_config(base(tokenize={"chat_template_kwargs": kwargs}))["tokenize"]["chat_template_kwargs"]
    assert got == {"enable_thinking": False, "budget": 512, "t": 0.5, "none": None, "name": "low", "l": [True]}


@pytest.mark.parametrize(
    ("key", "what"),
    [
        ("add_generation_prompt", "an apply_chat_template argument"),
        ("messages", "an apply_chat_template argument"),
        ("conversations", "an apply_chat_template argument"),
        ("tools", "an apply_chat_template argument"),
        ("chat_template", "an apply_chat_template argument"),
        ("return_assistant_tokens_mask", "an apply_chat_template argument"),
        ("continue_final_message", "an apply_chat_template argument"),
        ("bos_token", "a special token of the tokenizer"),
        ("eos_token", "a special token of the tokenizer"),
    ],
)
def test_a_key_the_encoder_passes_itself_is_refused_in_one_line(key, what):
    with pytest.raises(ConfigError) as e:
        validate_config(base(tokenize={"chat_template_kwargs": {"enable_thinking": False, key: True}}))
    message = str(e.value)
    assert message.startswith(f"config error: tokenize.chat_template_kwargs.{key}: the encoder passes {key} ")
    assert f"({what})" in message and "\n" not in message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("enable_thinking=false", "tokenize.chat_template_kwargs = 'enable_thinking=false': "),
        ({"when": [object()]}, "tokenize.chat_template_kwargs.when.0 = <object"),
    ],
)
def test_a_value_that_is_no_mapping_of_json_values_is_one_line(value, message):
    with pytest.raises(ConfigError) as e:
        validate_config(base(tokenize={"chat_template_kwargs": value}))
    assert str(e.value).startswith(f"config error: {message}") and "\n" not in str(e.value)


# A Qwen3-style switch: with enable_thinking false, every assistant header (the generation prompt's too) carries
# an empty think block, outside the reply; unset, the template renders as it would without the variable.
HEADER = (
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
)
THINKING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    + HEADER
    + "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + HEADER + "{%- endif -%}"
)
NO_THINKING = {"enable_thinking": False}

CONVS = [
    [{"role": "user", "content": "How do I fix a chain?"}, {"role": "assistant", "content": "Clean it, then oil it."}],
    [
        {"role": "system", "content": "You are a patient teacher."},
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": "Light scatters."},
        {"role": "user", "content": "And at night?"},
        {"role": "assistant", "content": " There is no sunlight.\n\n"},
    ],
    [
        {"role": "assistant", "content": "I speak first."},
        {"role": "user", "content": "Fine."},
        {"role": "assistant", "content": "Café, naïve, 東京 ✓"},
    ],
]


def model_with_template(tmp_path: Path, demo_model_dir: Path, template: str, name: str) -> Path:
    """A tokenizer-only model folder: the demo tokenizer with `template` as its chat template."""
    folder = tmp_path / name
    folder.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / file, folder / file)
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture
def thinking_models(tmp_path, demo_model_dir) -> dict[str, Path]:
    """The switch template with {% generation %} markers, and without them (the render-boundary mask)."""
    plain = THINKING_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    return {
        "generation_markers": model_with_template(tmp_path, demo_model_dir, THINKING_TEMPLATE, "markers"),
        "render_boundary": model_with_template(tmp_path, demo_model_dir, plain, "boundary"),
    }


def tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("source", ["generation_markers", "render_boundary"])
def test_rows_equal_apply_chat_template_with_the_kwargs_one_conversation_at_a_time(thinking_models, source):
    encoder = ChatEncoder(tokenizer(thinking_models[source]), thinking_models[source], True, NO_THINKING)
    assert encoder.mask_source == source
    # The reference: transformers on the marked template (the boundary's mask must be the markers' mask).
    ref_tok = tokenizer(thinking_models["generation_markers"])
    for messages, (ids, mask) in zip(CONVS, encoder.encode(CONVS), strict=True):
        ref = ref_tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **NO_THINKING
        )
        assert (ids, list(mask)) == (ref["input_ids"], ref["assistant_masks"])
        # Not vacuous: every reply has its empty think block, outside the mask (template glue).
        replies = sum(m["role"] == "assistant" for m in messages)
        assert ref_tok.decode(ids).count("<think>\n\n</think>\n\n") == replies
        assert "<think>" not in ref_tok.decode([t for t, m in zip(ids, mask, strict=True) if m])


def test_the_generation_prompt_gets_the_kwargs_too(thinking_models):
    folder = thinking_models["render_boundary"]
    encoder = ChatEncoder(tokenizer(folder), folder, True, NO_THINKING)
    prompt = encoder._render([CONVS[0][:1]], add_generation_prompt=True)[0]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert encoder.template_kwargs == {**encoder.tokenizer.special_tokens_map, "enable_thinking": False}


@pytest.mark.parametrize("source", ["generation_markers", "render_boundary"])
def test_the_default_renders_as_before(thinking_models, demo_model_dir, source):
    # {} (and no argument) give what the encoder gave before the key existed: apply_chat_template with no
    # keyword arguments, on the switch template (its variable unset) and on the demo's own template.
    for folder in (thinking_models[source], demo_model_dir):
        tok = tokenizer(folder)
        before = ChatEncoder(tok, folder, template_fallback=True, chat_template_kwargs={}).encode(CONVS)
        assert ChatEncoder(tok, folder, True, {}).encode(CONVS) == before
        assert ChatEncoder(tok, folder, True, {}).template_kwargs == dict(tok.special_tokens_map)
        for messages, (ids, _) in zip(CONVS, before, strict=True):
            assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    with_kwargs = ChatEncoder(tokenizer(thinking_models[source]), thinking_models[source], True, NO_THINKING)
    assert with_kwargs.encode(CONVS) != ChatEncoder(
        tokenizer(thinking_models[source]), thinking_models[source], template_fallback=True, chat_template_kwargs={}
    ).encode(CONVS)


def test_the_encoder_refuses_a_special_token_of_its_tokenizer_in_one_line(demo_model_dir):
    tok = tokenizer(demo_model_dir)
    for key in ("bos_token", "pad_token", "add_generation_prompt"):
        with pytest.raises(TokenizeError) as e:
            ChatEncoder(tok, demo_model_dir, True, {key: "x"})
        assert f"tokenize.chat_template_kwargs.{key}: the encoder passes {key}" in str(e.value)
        assert "\n" not in str(e.value)


def tokenize(tmp_path: Path, folder: Path, name: str, **kw) -> tuple[dict, dict[str, bytes]]:
    """tokenize_conversations of CONVS into 2 shards; (stats, {file name: bytes} of the shards)."""
    src = tmp_path / "conversations.jsonl"
    src.write_text(
        "".join(json.dumps(Conversation(f"c{i}", m, f"t:{i}").to_json()) + "\n" for i, m in enumerate(CONVS))
    )
    out = tmp_path / name
    shards = [out / f"shard_{k}.jsonl" for k in range(2)]
    kw = {"template_fallback": True, "trust_remote_code": False, "workers": 2, "chat_template_kwargs": {}, **kw}
    stats = tokenize_conversations(
        src,
        folder,
        shards,
        out / "stats.json",
        out / "freq.json",
        out / "q.jsonl",
        max_seq_len=256,
        batch_size=2,
        **kw,
    )
    assert json.loads((out / "stats.json").read_text()) == stats
    return stats, {p.name: p.read_bytes() for p in shards}


def test_the_stage_renders_with_the_kwargs_in_worker_processes_too_and_records_them(tmp_path, thinking_models):
    folder = thinking_models["render_boundary"]
    one = tokenize(tmp_path, folder, "one", chat_template_kwargs=NO_THINKING)
    two = tokenize(tmp_path, folder, "two", chat_template_kwargs=NO_THINKING, workers=2)
    assert one[1] == two[1]
    rows = [json.loads(line) for data in one[1].values() for line in data.decode().splitlines()]
    encoder = ChatEncoder(tokenizer(folder), folder, True, NO_THINKING)
    assert [(r["input_ids"], r["loss_mask"]) for r in rows] == [(i, list(m)) for i, m in encoder.encode(CONVS)]
    # Beside the template's hash, which stays the hash of the template.
    stats = one[0]
    assert stats["chat_template_kwargs"] == NO_THINKING
    default = tokenize(tmp_path, folder, "default")
    assert default[0]["chat_template_kwargs"] == {} and default[1] != one[1]
    assert default[0]["chat_template_sha256"] == stats["chat_template_sha256"]
    assert tokenize(tmp_path, folder, "empty", chat_template_kwargs={})[1] == default[1]


# ---- regenerate: its prompts are rendered as tokenize renders the rows ---------------------------------------


def test_regenerate_prompts_are_the_tokenize_rows_up_to_the_reply_with_the_kwargs(thinking_models):
    folder = thinking_models["generation_markers"]
    renderer = PromptRenderer.load(folder, trust_remote_code=False, chat_template_kwargs=NO_THINKING)
    encoder = ChatEncoder(tokenizer(folder), folder, True, NO_THINKING)
    for messages in CONVS[:2]:
        ids, mask = encoder.encode([messages])[0]
        first_reply = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        text, prompt = renderer.prompt(messages[:first_reply])
        assert prompt == ids[: mask.index(1)] and text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert renderer.render(CONVS[1]) == encoder._render([CONVS[1]], add_generation_prompt=False)[0]
    assert (
        PromptRenderer.load(folder, trust_remote_code=False, chat_template_kwargs={})
        .prompt(CONVS[0][:1])[0]
        .endswith("<|im_start|>assistant\n")
    )  # the default
    with pytest.raises(TokenizeError, match=r"tokenize.chat_template_kwargs.eos_token: the encoder passes"):
        PromptRenderer.load(folder, trust_remote_code=False, chat_template_kwargs={"eos_token": "x"})


def test_the_regenerate_job_takes_the_kwargs_from_its_params_to_the_engine_and_the_manifest(
    tmp_path, thinking_models, demo_model_dir, monkeypatch
):
    import eagle3prep.regenerate.engine as engine_module

    folder = thinking_models["generation_markers"]
    shutil.copy(demo_model_dir / "config.json", folder / "config.json")  # the job reads the model's context
    config = validate_config(base(tokenize={"chat_template_kwargs": NO_THINKING}))
    assert RegenerateSettings.params(config)["chat_template_kwargs"] == NO_THINKING
    assert "chat_template_kwargs" not in RegenerateSettings.params(validate_config(base()))  # {}: the params as before

    engines = []

    class FakeVLLM(FakeEngine):
        """VLLMEngine's constructor and context, FakeEngine's requests (decoded with the target's tokenizer)."""

        def __init__(self, model_path, settings, sampling, stop_ids, max_model_len, trust_remote_code):
            super().__init__(PromptRenderer.load(model_path, trust_remote_code=False, chat_template_kwargs={}), echo)
            self.volatile = {}
            engines.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def start(self):
            return {"engine": "fake"}

    monkeypatch.setattr(engine_module, "VLLMEngine", FakeVLLM)
    prepared = tmp_path / "prepared.jsonl"
    prepared.write_text("".join(json.dumps(c) + "\n" for c in [regen_conv([U1, A1, U2], "a"), regen_conv([U2], "b")]))
    split_conversations(prepared, [tmp_path / "prompts" / "shard_0.jsonl"])
    manifest = run_regenerate_job(
        RegeneratePaths(str(tmp_path / "prompts" / "shard_0.jsonl"), str(tmp_path / "shard_0"), str(folder), shard=0),
        RegenerateJobSettings(RegenerateSettings.from_config(config), config["tokenize"]["chat_template_kwargs"],
                              trust_remote_code=False, max_seq_len=256, threads=None),
    )  # fmt: skip
    prompts = list(engines[0].prompts.values())
    assert len(prompts) == 3 and all(p.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for p in prompts)
    assert manifest["chat_template_kwargs"] == NO_THINKING


def test_merge_refuses_shards_rendered_with_other_kwargs():
    made_before = {"model": {}, "tokenizer": {}}  # a manifest written before the key: rendered with none
    _check_same_settings(["s0", "s1"], [{**made_before, "chat_template_kwargs": {}}, made_before])
    with pytest.raises(ShardError, match=r"s1 was regenerated with another chat_template_kwargs than s0"):
        _check_same_settings(["s0", "s1"], [{**made_before, "chat_template_kwargs": NO_THINKING}, made_before])


def test_the_report_shows_the_kwargs_tokenize_recorded():
    from eagle3prep.report.page import template_kwargs_cell

    assert template_kwargs_cell({"enable_thinking": False}) == "<code>{&quot;enable_thinking&quot;: false}</code>"
    assert template_kwargs_cell({}) == "none (the template's defaults)"
    assert template_kwargs_cell(None) == "not recorded"  # stats.json of a run made before the key
