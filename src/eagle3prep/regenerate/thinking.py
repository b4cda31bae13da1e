"""Reasoning models (Qwen3, DeepSeek-R1, Kimi-K2.5) write thinking text between two markers before their answer.
regenerate.thinking says what becomes of it in the stored reply:

    keep   the reply keeps its thinking in the shape the chat template reads: in `reasoning_content` (form
           "field") when the template renders that key, else in `content` as generated (form "inline"). The
           template then renders it where the served model sees it (Qwen3's keeps the final turn's thinking
           and drops earlier turns').
    strip  the thinking is removed; `content` is the answer alone.
    auto   (default) what the template does with a final assistant turn's thinking: keep in the field it reads,
           keep inline when it renders content as given, strip when it drops the thinking even there.

Some templates end the generation prompt with the opening marker ("<think>\\n"), so the generated text starts
inside the thinking: `prompt_prefill` finds that tail, and it counts as the start of the reply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_THOUGHT, _ANSWER = "e3p-probe-thought", "e3p-probe-answer"


@dataclass(frozen=True, slots=True)
class ThinkingPlan:
    """What the job does with thinking text, and why (recorded in every shard manifest)."""

    config: str  # regenerate.thinking as configured: auto | keep | strip
    mode: str  # keep | strip
    form: str  # field (reasoning_content) | inline (in content) | none (stripped)
    markers: tuple[str, str]
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "mode": self.mode, "form": self.form, "markers": list(self.markers),
                "why": self.why}  # fmt: skip


def resolve(config: str, markers: tuple[str, str], render: Callable[[list[dict[str, Any]]], str]) -> ThinkingPlan:
    """The plan for regenerate.thinking = `config`. `render(messages)` is the chat template's text of a whole
    conversation (no generation prompt); two probe renders tell which shape of thinking the template reads."""
    start, end = markers
    user = {"role": "user", "content": "Hi."}
    field = _renders(render, [user, {"role": "assistant", "content": _ANSWER, "reasoning_content": _THOUGHT}])
    inline = _renders(render, [user, {"role": "assistant", "content": f"{start}{_THOUGHT}{end}{_ANSWER}"}])
    if config == "strip":
        return ThinkingPlan(config, "strip", "none", markers, "regenerate.thinking: strip")
    if field:
        why = "the chat template renders an assistant message's reasoning_content"
        return ThinkingPlan(config, "keep", "field", markers, why)
    if config == "keep" or inline:
        why = (
            "the chat template renders thinking written in the content"
            if inline
            else "regenerate.thinking: keep; the chat template drops thinking written in the content, and does not read "
            "reasoning_content: kept in the content as generated"
        )
        return ThinkingPlan(config, "keep", "inline", markers, why)
    why = "the chat template drops the thinking of a final assistant turn (in the content, and reads no reasoning_content)"
    return ThinkingPlan(config, "strip", "none", markers, why)


def _renders(render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]]) -> bool:
    """Whether the probe's thought text survives the template (a template that fails on it does not read it)."""
    try:
        return _THOUGHT in render(messages)
    except Exception:  # a template may raise on a key or marker it does not expect, in any way
        return False


def prompt_prefill(prompt_text: str, markers: tuple[str, str]) -> str:
    """The tail of a generation prompt that opens the thinking ("<think>\\n"), or "" when it does not."""
    start = prompt_text.rfind(markers[0])
    if start < 0 or prompt_text[start + len(markers[0]) :].strip():
        return ""
    return prompt_text[start:]


@dataclass(frozen=True, slots=True)
class Split:
    """A reply's text cut at the markers; thinking is None when the reply has none."""

    thinking: str | None
    answer: str
    terminated: bool  # the end marker was found (False: cut inside the thinking, e.g. by max_tokens)


def split_thinking(text: str, markers: tuple[str, str]) -> Split:
    """`text` (prefill + generated) as thinking and answer. A reply that opens with the start marker thinks until
    the end marker; one with an end marker but no start marker (a template that prefilled it) thinks up to it."""
    start, end = markers
    body = text.lstrip()
    if body.startswith(start):
        inner = body[len(start) :]
        cut = inner.find(end)
        if cut < 0:
            return Split(inner, "", False)
        return Split(inner[:cut], inner[cut + len(end) :], True)
    cut = text.find(end)
    if cut >= 0 and start not in text[:cut]:
        return Split(text[:cut], text[cut + len(end) :], True)
    return Split(None, text, True)


def reply_message(generated: str, prefill: str, plan: ThinkingPlan) -> tuple[dict[str, Any], Split]:
    """The assistant message stored for a generated reply, and how its text split at the markers."""
    split = split_thinking(prefill + generated, plan.markers)
    if split.thinking is None:
        return {"role": "assistant", "content": generated}, split
    if plan.form == "inline":  # exactly what the model wrote, with the opening marker the prompt held
        return {"role": "assistant", "content": prefill + generated}, split
    answer = split.answer.lstrip()  # the whitespace after the end marker is template glue
    if plan.form == "field":
        return {"role": "assistant", "content": answer, "reasoning_content": split.thinking.strip("\n")}, split
    return {"role": "assistant", "content": answer}, split


def is_empty(message: dict[str, Any]) -> bool:
    """A reply with no visible text: no content and no kept thinking."""
    return not (message["content"].strip() or message.get("reasoning_content", "").strip())
