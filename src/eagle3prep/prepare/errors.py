"""What can go wrong in prepare: a source that cannot be read at all (InputError, the run stops), or one
record that cannot be kept (Rejected with one of REASONS, the record is quarantined)."""

from __future__ import annotations

from eagle3prep.errors import UserError

# Quarantine reasons, in the order they are checked.
REASONS = (
    "line_too_long",  # JSONL line over max_line_bytes (not parsed)
    "invalid_utf8",  # JSONL line that is not UTF-8, or content with a lone surrogate ("\\ud800")
    "invalid_json",  # JSONL line that does not parse
    "unknown_shape",  # neither {"messages": [...]} nor {"conversations": [...]}, or a message not an object
    "missing_role",  # a message without role/from
    "unknown_role",  # a role outside ROLE_MAP and TOOL_CALL_ROLES
    "invalid_tool_call",  # a tool call without a function name, or tool calls / `tools` that are not JSON
    "empty_content",  # content missing, null, "" or whitespace only (and no tool call), or an empty list of parts
    "non_string_content",  # content neither a string nor a list of text parts
    "non_text_content",  # a part that is neither text nor image (audio, ...), or an image outside a user message
    "misplaced_system",  # a system message anywhere but first
    "no_assistant_turn",  # no assistant message at all
    "no_user_turn",  # no user message at all: the replies answer nobody (kept with data.allow_no_user_turn)
)
# Quarantine reasons of images (read by the prepare rule: data.image_root, data.max_image_pixels), checked as
# each image is met. counts.json lists them only in a run that met an image, so text-only runs keep their bytes.
IMAGE_REASONS = (
    "image_remote_url",  # an http(s) (or other remote) URL: prepare has no network
    "image_missing",  # a local path or file:// URL that does not exist or cannot be read
    "image_unsupported_format",  # not PNG, JPEG, WEBP or single-frame GIF (SVG, TIFF, a data: URI of text, ...)
    "image_unreadable",  # not an image Pillow can read, truncated or corrupt, or a data: URI that is not base64
    "image_too_large",  # width x height over data.max_image_pixels
    "image_count_mismatch",  # <image> markers in the text != images in the record's `images` / `image` field
)


class InputError(UserError, ValueError):
    """A source that cannot be read at all; the message names the file (and line/field) and the fix."""


class NoConversationsError(InputError):
    """Prepare kept no conversation: the sources are empty, or every record in them was quarantined."""


class Rejected(Exception):
    """A record that is quarantined; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def keys_preview(d: dict) -> str:
    """The first ten keys of `d`, for an error message that says what a record holds instead."""
    keys = [str(k) for k in d]
    return "[" + ", ".join(keys[:10]) + (", ..." if len(keys) > 10 else "") + "]"
