"""Normalization: one raw record -> `[{"role", "content"}]` messages (plus tool calls and `tools` schemas in the
shape transformers' chat templates render), or Rejected with a REASONS reason; and the content hash that
identifies a conversation and finds its duplicates."""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Any

from eagle3prep.prepare.errors import Rejected, keys_preview
from eagle3prep.prepare.images import IMAGE_MARKER, ImageOptions, image_key

ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",  # OpenAI tool replies
    "function": "tool",  # OpenAI's older function replies
    "observation": "tool",  # ShareGPT (LLaMA-Factory) tool replies
    "ipython": "tool",  # Llama 3.1's tool replies
}
# ShareGPT turns whose value is the assistant's tool call(s) as JSON: {"name", "arguments"} or a list of them.
TOOL_CALL_ROLES = ("function_call", "tool_call", "tool_calls")

# Container key -> (role key, content key). Either pair is accepted in either container, native first,
# because many datasets put {role, content} messages under "conversations".
SHAPES = {"messages": ("role", "content"), "conversations": ("from", "value")}


def normalize(
    record: Any,
    allow_prompt_only: bool = False,
    *,
    allow_no_user_turn: bool,
    images: ImageOptions | None = None,
) -> list[dict[str, Any]]:
    """Return the normalized messages of one raw record, or raise Rejected with a REASONS reason.
    `allow_prompt_only`: keep a record without an assistant message (the regenerate stage writes the replies),
    or without a user message (that stage quarantines it as no_user_turn itself).
    `allow_no_user_turn`: keep a record without a user message (completion-style data, data.allow_no_user_turn).
    `images`: read images (OpenAI image parts, `<image>` markers with an `image` / `images` field); a user
    message with images gets a list of text and image parts as content. None: quarantined as non_text_content."""
    key, raw_messages = _container(record)
    role_keys = (SHAPES[key][0], *(r for r, _ in SHAPES.values() if r != SHAPES[key][0]))
    content_keys = (SHAPES[key][1], *(c for _, c in SHAPES.values() if c != SHAPES[key][1]))
    messages = [_message(m, i, f"{key}[{i}]", role_keys, content_keys, images) for i, m in enumerate(raw_messages)]
    if images is not None and (record.get("images") is not None or record.get("image") is not None):
        messages = _place_marked_images(record, key, messages, images)
    if not allow_prompt_only and not any(m["role"] == "assistant" for m in messages):
        raise Rejected("no_assistant_turn", f"none of the {len(messages)} messages is from the assistant")
    # Only a conversation with no user message at all: a greeting before the first one answers the system
    # prompt, as a served model may open (the regenerate stage draws the same line).
    if not (allow_prompt_only or allow_no_user_turn) and not any(m["role"] == "user" for m in messages):
        roles = ", ".join(sorted({m["role"] for m in messages}))
        raise Rejected(
            "no_user_turn",
            f"none of the {len(messages)} messages is from the user (roles: {roles}); "
            "set data.allow_no_user_turn: true if the dataset is completion-style",
        )
    return messages


def _container(record: Any) -> tuple[str, list]:
    """The record's one message list and its key ("messages" or "conversations"), or Rejected("unknown_shape")."""
    if not isinstance(record, dict):
        raise Rejected("unknown_shape", f"record is a {type(record).__name__}, expected an object")
    present = [k for k in SHAPES if record.get(k) is not None]
    if len(present) != 1:
        which = (
            "both 'messages' and 'conversations'"
            if present
            else f"no 'messages' or 'conversations' key (keys: {keys_preview(record)})"
        )
        raise Rejected("unknown_shape", f"record has {which}")
    key = present[0]
    raw_messages = record[key]
    if not isinstance(raw_messages, list):
        raise Rejected("unknown_shape", f"'{key}' is a {type(raw_messages).__name__}, expected a list of messages")
    return key, raw_messages


def _message(
    m: Any, i: int, where: str, role_keys: tuple, content_keys: tuple, images: ImageOptions | None = None
) -> dict[str, Any]:
    """Message `i` of a record normalized (role mapped, content checked, tool calls reshaped), or Rejected.
    `role_keys` / `content_keys`: the keys tried in order, the container's native pair first."""
    if not isinstance(m, dict):
        raise Rejected("unknown_shape", f"{where} is a {type(m).__name__}, expected an object")
    role_raw = next((m[k] for k in role_keys if m.get(k) is not None), None)
    if role_raw is None:
        raise Rejected("missing_role", f"{where} has no {' or '.join(repr(k) for k in role_keys)}")
    name = role_raw.strip().lower() if isinstance(role_raw, str) else None
    raw_content = next((m[k] for k in content_keys if m.get(k) is not None), None)
    if name in TOOL_CALL_ROLES:  # ShareGPT: the value is the call itself
        return {"role": "assistant", "content": "", "tool_calls": _tool_calls_json(raw_content, where)}
    role = ROLE_MAP.get(name)
    if role is None:
        known = ", ".join((*ROLE_MAP, *TOOL_CALL_ROLES))
        raise Rejected("unknown_role", f"{where} has role {role_raw!r} (known: {known})")
    calls = m.get("tool_calls") or ([m["function_call"]] if m.get("function_call") else None)
    if role == "assistant" and calls:
        calls = _tool_calls(calls, where)
        blank = raw_content is None or (isinstance(raw_content, str) and not raw_content.strip())
        content = "" if blank else _content(raw_content, where)
        return {"role": role, "content": content, "tool_calls": calls}
    content = _content(raw_content, where, images if role == "user" else None, role)
    if role == "system" and i > 0:
        raise Rejected("misplaced_system", f"{where} is a system message; only the first message may be")
    message = {"role": role, "content": content}
    if role == "tool":  # which call it answers, where the record says so (some templates render it)
        message.update((k, m[k]) for k in ("tool_call_id", "name") if isinstance(m.get(k), str))
    return message


def normalize_tools(record: dict) -> list[dict] | None:
    """The record's `tools` (function schemas for the chat template), a list of objects or None; OpenAI gives a
    list, ShareGPT (LLaMA-Factory) a JSON string of one. Raise Rejected("invalid_tool_call") otherwise."""
    tools = record.get("tools")
    if isinstance(tools, str):
        tools = _json_value(tools, "tools") if tools.strip() else None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Rejected("invalid_tool_call", f"'tools' is a {type(tools).__name__}, expected a list of objects")
    return tools


def _json_value(text: str, where: str) -> Any:
    """`text` parsed as JSON, or Rejected("invalid_tool_call"): tool calls and schemas may arrive as JSON text."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise Rejected("invalid_tool_call", f"{where} is not valid JSON") from None


def _tool_calls_json(value: Any, where: str) -> list[dict[str, Any]]:
    """A ShareGPT function_call turn's value: one call or a list of calls, as JSON text or already parsed."""
    calls = _json_value(value, where) if isinstance(value, str) else value
    return _tool_calls(calls if isinstance(calls, list) else [calls], where)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Tool calls in transformers' shape: {"type": "function", "function": {"name", "arguments"}} (+ "id"),
    arguments parsed to an object when they are a JSON object's text (what chat templates expect)."""
    if not isinstance(calls, list):
        raise Rejected("invalid_tool_call", f"{where} tool_calls is a {type(calls).__name__}, expected a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise Rejected("invalid_tool_call", f"{where} tool call {j} has no function name")
        args = fn.get("arguments", fn.get("parameters"))
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError, RecursionError):
                parsed = json.loads(args)
                args = parsed if isinstance(parsed, dict) else args
        elif args is None:
            args = {}
        elif not isinstance(args, dict):
            raise Rejected("invalid_tool_call", f"{where} tool call {j} has arguments of type {type(args).__name__}")
        entry: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


IMAGE_PART_TYPES = ("image_url", "image")  # OpenAI's, and the one transformers' processors take


def _content(content: Any, where: str, images: ImageOptions | None = None, role: str = "user") -> str | list:
    """The message text, verbatim; a list of {"type": "text", "text": ...} parts is joined with "".
    With `images` (user messages only), image parts are read: the content is then a list of text and image parts."""
    if isinstance(content, list):
        if not content:
            raise Rejected("empty_content", f"{where} has an empty list of content parts")
        parts: list[Any] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind in IMAGE_PART_TYPES and images is not None:
                parts.append(images.read(_image_ref(part, kind), f"{where} content part {j}"))
                continue
            if kind != "text":
                why = (
                    f"; images are read in user messages only, this is {role}"
                    if kind in IMAGE_PART_TYPES and role != "user"
                    else ""
                )
                raise Rejected("non_text_content", f"{where} content part {j} is of type {kind!r}, not 'text'{why}")
            if not isinstance(part.get("text"), str):
                raise Rejected(
                    "non_string_content",
                    f"{where} content part {j} has 'text' of type {type(part.get('text')).__name__}",
                )
            parts.append(part["text"])
        if any(isinstance(p, dict) for p in parts):
            return _check_text(_parts(parts), where)
        content = "".join(parts)  # HF chat templates concatenate text parts with no separator
    if content is None:
        raise Rejected("empty_content", f"{where} has no content")
    if not isinstance(content, str):
        raise Rejected("non_string_content", f"{where} content is a {type(content).__name__}, expected a string")
    if not content.strip():
        raise Rejected("empty_content", f"{where} content is empty or whitespace only")
    return _check_text(content, where)


def _check_text(content: str | list, where: str) -> str | list:
    """`content` unchanged, or Rejected("invalid_utf8") for text that no UTF-8 can hold."""
    for text in [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]:
        try:  # JSON may escape a lone surrogate ("\\ud800"): valid JSON, but no UTF-8 can hold it
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise Rejected("invalid_utf8", f"{where} content has a lone surrogate at character {e.start}") from None
    return content


def _parts(items: list[str | dict]) -> list[dict[str, Any]]:
    """Texts and image parts in order as content parts; adjacent texts joined (as chat templates render them),
    empty ones dropped."""
    parts: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, dict):
            parts.append(item)
        elif item and parts and parts[-1]["type"] == "text":
            parts[-1] = {"type": "text", "text": parts[-1]["text"] + item}
        elif item:
            parts.append({"type": "text", "text": item})
    return parts


def _image_ref(part: dict, kind: str) -> Any:
    """The image an image part names: OpenAI {"image_url": {"url"}} (or a bare string), or transformers'
    {"image"} / {"url"} / {"path"}."""
    value = part.get(kind) if part.get(kind) is not None else part.get("url", part.get("path"))
    return value.get("url") if isinstance(value, dict) and "bytes" not in value else value


def _place_marked_images(record: dict, key: str, messages: list[dict], images: ImageOptions) -> list[dict]:
    """LLaVA / ShareGPT: each `<image>` marker in the text is replaced by the next image of the record's `images`
    (or `image`) field, in message order; as many markers as images, in user messages only."""
    field_name = "images" if record.get("images") is not None else "image"
    refs = record[field_name]
    refs = list(refs) if isinstance(refs, list | tuple) else [refs]
    texts = [m["content"] if isinstance(m["content"], str) else "" for m in messages]
    n_markers = sum(t.count(IMAGE_MARKER) for t in texts)
    if n_markers != len(refs):
        raise Rejected(
            "image_count_mismatch",
            f"{n_markers} {IMAGE_MARKER} marker{'s' * (n_markers != 1)} in the text, "
            f"{len(refs)} image{'s' * (len(refs) != 1)} in '{field_name}'",
        )
    out, k = [], 0
    for i, (m, text) in enumerate(zip(messages, texts, strict=True)):
        if IMAGE_MARKER not in text:
            out.append(m)
            continue
        if m["role"] != "user":
            raise Rejected(
                "non_text_content",
                f"{key}[{i}] has {IMAGE_MARKER} but is {m['role']}; images are read in user messages only",
            )
        items: list[str | dict] = []
        for j, piece in enumerate(text.split(IMAGE_MARKER)):
            if j:
                items.append(images.read(refs[k], f"{field_name}[{k}]"))
                k += 1
            items.append(piece)
        out.append({**m, "content": _parts(items)})
    return out


def conversation_id(messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
    """sha256 (hex) of the canonical JSON of normalized messages (and tools, when the record has them): stable
    across runs and machines."""
    return conversation_digest(messages, tools).hex()


def conversation_digest(messages: list[dict[str, Any]], tools: list[dict] | None = None) -> bytes:
    """The 32-byte sha256 behind `conversation_id`; prepare keeps these, not hex strings, to find duplicates."""
    return hashlib.sha256(_canonical(messages, tools)).digest()


def _canonical(messages: list[dict[str, Any]], tools: list[dict] | None = None) -> bytes:
    """The bytes `conversation_id` hashes: sorted keys, no spaces, UTF-8, so that equal content gives one id."""
    if any(isinstance(m.get("content"), list) for m in messages):  # images count by their bytes, not their path
        messages = [
            {**m, "content": [image_key(p) if p["type"] == "image" else p for p in m["content"]]}
            if isinstance(m.get("content"), list) else m
            for m in messages
        ]  # fmt: skip
    value = {"messages": messages, "tools": tools} if tools else messages  # ids without tools are unchanged
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
