"""tokenize.chat_template_kwargs: extra chat-template variables (Qwen3's enable_thinking), checked at config
validation and handed to every render as apply_chat_template's keyword arguments."""

from __future__ import annotations

import pytest

from eagle3prep.config import ConfigError, template_kwargs_params, validate_config


def base(**over):
    return {"data": {"sources": ["a.jsonl"]}, "model": {"path": "m"}, **over}


def test_the_default_is_empty_and_adds_no_rule_param():
    tokenize = validate_config(base())["tokenize"]
    assert tokenize["chat_template_kwargs"] == {}
    # Snakemake compares a rule's params as a whole: a new one at its default would re-queue old runs.
    assert template_kwargs_params(tokenize) == {}
    assert template_kwargs_params({"chat_template_kwargs": {"enable_thinking": False}}) == {
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
