"""What the chat-template encoder and the image path (vision.py) share: a conversation's Rejected reason and
the two ways of turning character spans into a loss mask. Apart from template.py, so that vision.py needs
nothing of the encoder's module and the two import in one direction only (template -> vision)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Rejected:
    """A conversation the encoder could not turn into a row."""

    reason: str
    detail: str


def marker_mask(enc, span: list[tuple[int, int]]) -> bytearray:
    """The loss mask of an encoding from its {% generation %} character spans: apply_chat_template's rule, kept
    exactly: from the token holding the block's first character to the one holding its last (to the end when
    that one is not found)."""
    mask = bytearray(len(enc.ids))
    for start_char, end_char in span:
        start = enc.char_to_token(start_char)
        if start is None:
            break
        end = enc.char_to_token(end_char - 1)
        end = end + 1 if end else len(enc.ids)
        mask[start:end] = b"\x01" * (end - start)
    return mask


def boundary_mask(enc, span: list[tuple[int, int]]) -> bytearray:
    """The loss mask of an encoding from its assistant character spans: a token is masked when its characters
    overlap one."""
    import numpy as np

    offsets = np.array(enc.offsets, dtype=np.int64).reshape(-1, 2)  # [T, 2] character [start, end)
    mask = np.zeros(len(offsets), dtype=bool)
    for s, e in span:
        mask |= (offsets[:, 0] < e) & (offsets[:, 1] > s)
    return bytearray(mask.view(np.uint8))
