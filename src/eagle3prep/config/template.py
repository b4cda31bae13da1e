"""tokenize.chat_template_kwargs against what the encoder already hands the chat template: a key among those
would override the encoder's value or change how the template is called."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from ..errors import ConfigError

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
