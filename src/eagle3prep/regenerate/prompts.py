"""Prompts as token ids, made the way the tokenize stage makes rows: the target's chat template rendered by
transformers' apply_chat_template with the same tokenize.chat_template_kwargs, encoded by the same Rust tokenizer
with no special tokens added (tokenize.template). The engine is given these ids (vLLM's LLM.generate with
token-id prompts), not messages: LLM.chat would render with vLLM's own chat handling (content-format detection,
its tool-call preprocessing), which is not guaranteed to give the bytes tokenize renders. Replies come back as
token ids and are decoded here with the same tokenizer.

A prompt with images is rendered the same way, then its images are loaded, checked and expanded by
tokenize.vision as tokenize does; the engine is given one placeholder an image and the images.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3prep.tokenize.template import (
    Rejected,
    get_chat_template,
    load_tokenizer,
    rust_backend,
    template_kwargs,
)
from eagle3prep.tokenize.vision import (
    UNSUPPORTED,
    collapse_runs,
    image_parts,
    load_images,
    load_vision,
    media_token_ids,
)


class PromptRenderer:
    """The target's tokenizer and chat template: messages -> (prompt text, prompt ids); reply ids -> text.
    `chat_template_kwargs` (tokenize.chat_template_kwargs) go to every render, as tokenize's ChatEncoder gives them."""

    def __init__(
        self,
        tokenizer,
        model_path: str | os.PathLike,
        chat_template_kwargs: Mapping[str, Any],
    ):
        self.tokenizer = tokenizer
        self.model_path = str(model_path)
        self.template = get_chat_template(tokenizer, model_path)  # a TokenizeError naming the fix when missing
        self.chat_template_kwargs = template_kwargs(tokenizer, chat_template_kwargs, model_path)
        self.backend = rust_backend(tokenizer)
        self._vision = None  # the target's image side (tokenize.vision), loaded at the first image prompt
        self.media_ids = media_token_ids(model_path)  # the target's vision placeholders; {} for a text target

    @classmethod
    def load(
        cls,
        model_path: str | os.PathLike,
        trust_remote_code: bool,
        chat_template_kwargs: Mapping[str, Any],
    ) -> PromptRenderer:
        return cls(load_tokenizer(model_path, trust_remote_code), model_path, chat_template_kwargs)

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None, generation: bool = False) -> str:
        """The template's text of `messages` (with the generation prompt when `generation`), as tokenize renders."""
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation, **self.chat_template_kwargs
        )

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """The generation prompt after `messages`: its text and its token ids."""
        text = self.render(messages, tools, generation=True)
        return text, self.encode(text)

    def image_prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None = None):
        """The generation prompt after `messages` that hold images: (its text and ids with every image expanded to
        its vision tokens, as tokenize's row; the engine's ids, one placeholder an image; the images as RGB PIL
        images, sha256-checked), or Rejected (an image gone or changed, a target without images)."""
        if self._vision is None:
            self._vision = load_vision(self.model_path, self.tokenizer)
        if isinstance(self._vision, str):
            return Rejected(UNSUPPORTED, self._vision)
        parts = image_parts(messages)
        pils = load_images(parts)
        if isinstance(pils, Rejected):
            return pils
        got = self._vision.expand(self.render(messages, tools, generation=True), [], parts, pils)
        if isinstance(got, Rejected):
            return got
        text, ids = got[0], self.encode(got[0])
        return text, ids, collapse_runs(ids, self._vision.image_token_id), pils

    @property
    def image_token_id(self) -> int | None:
        """The target's image placeholder id, once an image prompt has loaded its image side; else None."""
        return getattr(self._vision, "image_token_id", None)

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        """Replies' ids as text, in one call of the Rust tokenizer (its threads). Special tokens the model wrote
        stay in the text and no space is cleaned up (transformers' decode with skip_special_tokens=False,
        clean_up_tokenization_spaces=False), so that rendering the text again gives the model's tokens back
        wherever the tokenizer allows it."""
        return self.backend.decode_batch(batch, skip_special_tokens=False) if batch else []

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of many texts in one call of the Rust tokenizer (its threads)."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)] if texts else []

    def stop_token_ids(self) -> list[int]:
        """Tokens that end a reply: the tokenizer's eos and generation_config.json's eos_token_id (one or a list).
        The engine gets them explicitly: it starts without a tokenizer (skip_tokenizer_init)."""
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen = Path(self.model_path) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
            ids.update(int(i) for i in ([eos] if isinstance(eos, int) else eos or []))
        return sorted(ids)
