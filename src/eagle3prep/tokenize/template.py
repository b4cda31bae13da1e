"""Chat-template rendering and the assistant loss mask: the target's tokenizer loaded from its folder, and
ChatEncoder, which turns conversations into (input_ids, loss_mask) or a Rejected reason.

The mask is 1 exactly on assistant tokens. It comes from the chat template's `{% generation %}` markers when
the template has them, else (tokenize.template_fallback) from the render boundary: for assistant turn i, the
text between render(messages[:i], add_generation_prompt=True) and render(messages[:i+1]), less trailing
whitespace (template glue such as the "\\n" after <|im_end|>). On the demo tokenizer both give the same mask.

Every render gets tokenize.chat_template_kwargs (template variables such as Qwen3's enable_thinking) the way
apply_chat_template gets keyword arguments; names the encoder passes itself are refused (template_kwargs).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3prep.config.template import template_kwarg_clash, template_kwargs_error
from eagle3prep.errors import UserError
from eagle3prep.tokenize.files import missing_tokenizer_files
from eagle3prep.tokenize.masks import Rejected, boundary_mask, marker_mask

# The test transformers itself uses to decide whether a template tracks generation spans.
GENERATION_RE = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
PROBE = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello, how can I help?"}]
TOOL_REASON = "tool_turns_unsupported_by_template"
SENTINEL = "zqxtoolpart"  # tool_probe's sentinel words start with it


class TokenizeError(UserError, ValueError):
    """The model folder's tokenizer or chat template cannot make rows; the message names the folder and the fix."""


class ModelNotFoundError(UserError, FileNotFoundError):
    """model.path is not a folder."""


def load_tokenizer(model_path: str | os.PathLike, trust_remote_code: bool):
    """The target model's tokenizer, from its local folder only (no hub access)."""
    if not Path(model_path).is_dir():
        raise ModelNotFoundError(
            f"model folder {model_path} not found; set model.path to a Hugging Face model folder "
            "(or model.build_demo: true to build the demo model there)"
        )
    if missing := missing_tokenizer_files(model_path, trust_remote_code):
        raise TokenizeError(missing)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code, local_files_only=True)
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizeError(
            f"{model_path}: the tokenizer is a slow (Python) tokenizer, but the loss mask needs character offsets; "
            "add a tokenizer.json (a fast tokenizer) to the model folder"
        )
    return tokenizer


def get_chat_template(tokenizer, model_path: str | os.PathLike) -> str:
    """The tokenizer's chat template text, or TokenizeError naming the folder and the fix."""
    try:
        return tokenizer.get_chat_template()
    except ValueError:
        raise TokenizeError(
            f"{model_path}: the tokenizer has no usable chat template (no chat_template.jinja, no default "
            "chat_template in tokenizer_config.json); copy the instruct model's chat_template.jinja into the folder"
        ) from None


def rust_backend(tokenizer):
    """The Rust tokenizer behind `tokenizer`, set as `tokenizer(texts, add_special_tokens=False)` sets it
    (PreTrainedTokenizerFast.set_truncation_and_padding), so that calling it directly gives the same ids."""
    backend = tokenizer.backend_tokenizer
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = tokenizer.split_special_tokens
    return backend


def template_kwargs(tokenizer, kwargs: Mapping[str, Any] | None, model_path: str | os.PathLike) -> dict[str, Any]:
    """tokenize.chat_template_kwargs as a new dict, or TokenizeError naming a key the encoder passes the template
    itself: an apply_chat_template argument, or a special token of this tokenizer (some name their own)."""
    kwargs = dict(kwargs or {})
    for key in kwargs:
        what = template_kwarg_clash(key, tokenizer.special_tokens_map)
        if what:
            raise TokenizeError(f"{model_path}: {template_kwargs_error(key, what)}")
    return kwargs


def choose_mask_source(template: str, template_fallback: bool, model_path: str | os.PathLike) -> str:
    """Where the loss mask comes from: "generation_markers" when the template has them, else
    "render_boundary" if tokenize.template_fallback allows it; TokenizeError otherwise."""
    if GENERATION_RE.search(template):
        return "generation_markers"
    if template_fallback:
        return "render_boundary"
    raise TokenizeError(
        f"{model_path}: the chat template has no {{% generation %}} markers and tokenize.template_fallback "
        "is false; set tokenize.template_fallback: true, or wrap the assistant content in "
        "{% generation %}...{% endgeneration %} in the model's chat template"
    )


class ChatEncoder:
    """Renders conversations with the target's chat template; returns (input_ids, loss_mask) per conversation:
    what `apply_chat_template(..., return_assistant_tokens_mask=True)` gives one at a time (tests/test_tokenization.py
    checks it), but one Rust encode call per batch and masks from character spans, with no Python loop over tokens.

    Args:
        tokenizer: a fast transformers tokenizer with a chat template.
        model_path: only for error messages.
        template_fallback: without `{% generation %}` markers, derive the mask from the render boundary.
        chat_template_kwargs: extra template variables (tokenize.chat_template_kwargs), given to every render.
    """

    def __init__(
        self,
        tokenizer,
        model_path: str | os.PathLike,
        template_fallback: bool,
        chat_template_kwargs: Mapping[str, Any],
    ):
        """Set up the template, the Rust tokenizer and the mask source; raise TokenizeError if no mask comes out."""
        self.tokenizer = tokenizer
        self.model_path = model_path
        self._vision = None  # the target's image side (tokenize.vision), loaded at the first image row
        self.template = get_chat_template(tokenizer, model_path)
        self.chat_template_kwargs = template_kwargs(tokenizer, chat_template_kwargs, model_path)
        # The variables apply_chat_template hands the template: the special tokens (bos_token, eos_token, ...),
        # then its keyword arguments (none of which is a special token's name: template_kwargs refuses those).
        self.template_kwargs = {**tokenizer.special_tokens_map, **self.chat_template_kwargs}
        self.backend = rust_backend(tokenizer)
        # str(token id) for every id: looking it up is 3x faster than formatting it, row after row.
        self.id_str = [str(i) for i in range(max(self.backend.get_vocab(with_added_tokens=True).values()) + 1)]
        self.mask_source = choose_mask_source(self.template, template_fallback, model_path)
        self._check_probe(model_path)

    def _check_probe(self, model_path: str | os.PathLike) -> None:
        """Raise TokenizeError unless a user/assistant probe gets a loss mask: a template the mask cannot
        be derived from must stop the run at start, not quarantine every conversation."""
        probe = self.encode([PROBE])[0]
        if isinstance(probe, Rejected) or not any(probe[1]):
            why = probe.detail if isinstance(probe, Rejected) else "no token of the assistant reply is masked"
            fix = (
                "fix the {% generation %} block"
                if self.mask_source == "generation_markers"
                else "add {% generation %}...{% endgeneration %} around the assistant content"
            )
            raise TokenizeError(
                f"{model_path}: cannot derive the loss mask from the chat template ({self.mask_source}) "
                f"on a user/assistant probe: {why}; {fix} in the model's chat template"
            )

    def encode(
        self, batch: list[list[dict[str, Any]]], tools: list[list[dict] | None] | None = None
    ) -> list[tuple[list[int], bytearray] | Rejected]:
        """One result per conversation: (input_ids, loss_mask as bytes 0/1), not truncated, or Rejected.
        `tools`: each conversation's tool schemas (or None), rendered by the template with its tool turns."""
        tools = tools or [None] * len(batch)
        with_images = [i for i, m in enumerate(batch) if has_images(m)]
        agentic = [
            i
            for i, (m, t) in enumerate(zip(batch, tools, strict=True))
            if (t or has_tool_turns(m)) and not has_images(m)
        ]
        if not agentic and not with_images:
            return self._encode_plain(batch)
        results: list = [None] * len(batch)
        plain = sorted(set(range(len(batch))) - set(agentic) - set(with_images))
        for i, result in zip(plain, self._encode_plain([batch[i] for i in plain]), strict=True):
            results[i] = result
        for i in agentic:  # one at a time: the template gets each conversation's own tools
            results[i] = self._encode_agentic(batch[i], tools[i])
        for i in with_images:  # one at a time: (ids, mask, the row's image record)
            results[i] = self._encode_images(batch[i], tools[i])
        return results

    def _encode_images(self, messages: list[dict[str, Any]], tools: list[dict] | None):
        """A conversation with images: (ids, mask, the row's image record) or Rejected (tokenize.vision)."""
        from eagle3prep.tokenize.vision import encode_with_images

        return encode_with_images(self, messages, tools)

    def _encode_agentic(self, messages: list[dict[str, Any]], tools: list[dict] | None):
        """One conversation with tool turns or schemas, or Rejected(TOOL_REASON) when the template fails on them
        or drops part of them: its hidden states would not be what is served."""
        try:
            probe, probe_tools, parts = tool_probe(messages, tools)
            text = self._render([probe], add_generation_prompt=False, tools=probe_tools)[0]
            missing = dropped_tool_part(text, parts)
            if missing:
                return Rejected(TOOL_REASON, f"the chat template does not render tool turns: {missing}")
            if self.mask_source == "generation_markers":
                return self._encode_markers([messages], tools)[0]
            return self._encode_boundary([messages], tools)[0]
        except Exception as e:  # a template may fail on tool turns in any way (TypeError on a None, ...)
            return Rejected(TOOL_REASON, f"the chat template cannot render tool turns: {type(e).__name__}: {e}")

    def _encode_plain(self, batch: list[list[dict[str, Any]]]) -> list[tuple[list[int], bytearray] | Rejected]:
        """A batch without tool turns; a template error rejects only the conversation that raised it."""
        import jinja2

        if not batch:
            return []
        try:
            if self.mask_source == "generation_markers":
                return self._encode_markers(batch)
            return self._encode_boundary(batch)
        except jinja2.TemplateError as e:
            # One bad conversation (a template's raise_exception) must not sink its batch.
            if len(batch) == 1:
                return [Rejected("template_error", f"the chat template raised: {e}")]
            return [self._encode_plain([messages])[0] for messages in batch]

    def _encode_markers(self, batch, tools: list[dict] | None = None):
        """The generation-marker mask, from the renderer apply_chat_template uses (same arguments), which
        records the character span of every {% generation %} block."""
        from transformers.utils.chat_template_utils import render_jinja_template

        texts, spans = render_jinja_template(
            conversations=batch,
            tools=tools,
            chat_template=self.template,
            return_assistant_tokens_mask=True,
            **self.template_kwargs,
        )
        encs = self.backend.encode_batch(texts, add_special_tokens=False)
        return [(enc.ids, marker_mask(enc, span)) for enc, span in zip(encs, spans, strict=True)]

    def _render(self, conversations: list[list[dict[str, Any]]], add_generation_prompt: bool, tools=None) -> list[str]:
        """The conversations rendered as text, one call for the batch."""
        if not conversations:
            return []
        # A batched call also renders an empty history (the prompt before an opening assistant turn).
        return self.tokenizer.apply_chat_template(
            conversations,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.chat_template_kwargs,
        )

    def _encode_boundary(self, batch, tools: list[dict] | None = None):
        """The render-boundary mask: a token is an assistant token when its characters overlap an assistant
        span; a conversation whose spans cannot be found stays Rejected."""
        full, spans = self._boundary_spans(batch, tools)
        encs = self.backend.encode_batch(full, add_special_tokens=False)
        return [
            span if isinstance(span, Rejected) else (enc.ids, boundary_mask(enc, span))
            for enc, span in zip(encs, spans, strict=True)
        ]

    def _boundary_spans(self, batch, tools: list[dict] | None = None):
        """Each conversation rendered whole, and the character span of every assistant reply in it: the text
        between each turn's history rendered with the generation prompt and the history including the turn.
        Renders that are not prefixes of each other give Rejected("template_not_prefix_stable") instead."""
        turns = [
            (b, i) for b, messages in enumerate(batch) for i, m in enumerate(messages) if m["role"] == "assistant"
        ]
        full = self._render(batch, add_generation_prompt=False, tools=tools)
        prompts = self._render([batch[b][:i] for b, i in turns], add_generation_prompt=True, tools=tools)
        with_turn = self._render([batch[b][: i + 1] for b, i in turns], add_generation_prompt=False, tools=tools)
        spans: list[list[tuple[int, int]] | Rejected] = [[] for _ in batch]
        for (b, i), prompt, turn in zip(turns, prompts, with_turn, strict=True):
            if isinstance(spans[b], Rejected):
                continue
            if not turn.startswith(prompt):
                spans[b] = Rejected(
                    "template_not_prefix_stable",
                    f"messages[:{i}] rendered with the generation prompt is not a prefix of messages[:{i + 1}]",
                )
            elif not full[b].startswith(turn):
                spans[b] = Rejected(
                    "template_not_prefix_stable",
                    f"messages[:{i + 1}] rendered alone is not a prefix of the whole conversation rendered",
                )
            else:
                reply = turn[len(prompt) :].rstrip()
                spans[b].append((len(prompt), len(prompt) + len(reply)))
        return full, spans


def has_images(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation holds an image part (prepare's shape for images: content is a list of parts)."""
    return any(isinstance(m["content"], list) for m in messages)


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation holds a tool call or a tool reply (then it is encoded on its own, with its tools)."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def tool_probe(
    messages: list[dict[str, Any]], tools: list[dict] | None
) -> tuple[list[dict[str, Any]], list[dict] | None, list[tuple[str, str]]]:
    """The conversation and tools with every tool part (a call's name, each argument's name and value, a tool
    reply, a schema's name) swapped for its own sentinel word, and (sentinel, what is missing if the render
    lacks it) per part. The render shows whether the template wrote a part: a substring test does not, since
    a tool named `w` "is" in any text holding a w."""
    blob = json.dumps([messages, tools], ensure_ascii=False, default=str)
    base = SENTINEL
    while base in blob:  # a sentinel must not be found in the conversation's own text
        base += "q"
    parts: list[tuple[str, str]] = []

    def mark(missing: str) -> str:
        word = f"{base}{len(parts)}z"  # letters and digits: tojson, trim and escaping leave it whole
        parts.append((word, missing))
        return word

    probe = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            m = {**m, "content": mark(f"the tool reply of messages[{i}] is not in the rendered text")}
        elif m.get("tool_calls"):
            m = {**m, "tool_calls": [_probe_call(call, f"messages[{i}] calls", mark) for call in m["tool_calls"]]}
        probe.append(m)
    return probe, [_probe_tool(t, j, mark) for j, t in enumerate(tools)] if tools else tools, parts


def _probe_call(call: dict[str, Any], where: str, mark) -> dict[str, Any]:
    """One tool call with its name and arguments replaced by sentinels from `mark`."""
    fn = call["function"]
    said = f"{where} {fn['name']!r}, but"
    name = mark(f"{said} the call's name is not in the rendered text")
    args = fn["arguments"]
    if isinstance(args, dict):
        probe_args = {}
        for key in args:
            word = mark(f"{said} its argument {key!r} is not in the rendered text")
            probe_args[word] = mark(f"{said} the value of its argument {key!r} is not in the rendered text")
        args = probe_args
    elif isinstance(args, str) and args.strip():  # arguments that are not a JSON object stay text
        args = mark(f"{said} its arguments are not in the rendered text")
    return {**call, "function": {**fn, "name": name, "arguments": args}}


def _probe_tool(tool: dict, j: int, mark) -> dict:
    """One tool schema with its name replaced by a sentinel (not the calls' one: a schema list that names the
    tool must not stand in for a call that the template dropped)."""
    nested = isinstance(tool.get("function"), dict)
    schema = tool["function"] if nested else tool
    if not isinstance(schema.get("name"), str):
        return tool
    renamed = {
        **schema,
        "name": mark(f"tool {j} ({schema['name']!r}) of the record's tools is not in the rendered text"),
    }
    return {**tool, "function": renamed} if nested else renamed


def dropped_tool_part(text: str, parts: list[tuple[str, str]]) -> str | None:
    """What of the tool turns the probe's rendered `text` lacks (the first part of `tool_probe` whose sentinel is
    not in it), said in a few words; None when every part is there."""
    return next((missing for word, missing in parts if word not in text), None)
