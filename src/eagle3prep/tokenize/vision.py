"""Images in tokenize: each image of a conversation is loaded (its sha256 checked against
prepare's), run through the target's image processor, and its placeholder in the rendered text expanded to
as many vision tokens as the processor gives it at that resolution; the loss mask is 0 on them.

The expansion is the one Qwen2-VL / Qwen2.5-VL's processor does (`<|image_pad|>` repeated
t*h*w / merge_size**2 times for an image of patch grid (t, h, w)). It is done here, with
AutoImageProcessor and the tokenizer, because transformers 5.19 cannot construct Qwen2_5_VLProcessor without
torchvision (its video_processor check), and .venv has no torchvision (.venv-vllm does: envs/vllm-vision.txt).
Other families are refused per row, in one line, until their expansion rule is added.
The regenerate stage loads, checks and expands a prompt's images with the same functions (regenerate/prompts.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3prep.prepare.errors import Rejected as PrepareRejected
from eagle3prep.prepare.images import data_uri_bytes
from eagle3prep.tokenize.masks import Rejected, boundary_mask, marker_mask

# model_type -> how its processor writes an image into the text (the placeholder the chat template renders)
EXPANDS = {"qwen2_vl": "<|image_pad|>", "qwen2_5_vl": "<|image_pad|>"}
UNSUPPORTED = "images_unsupported_by_target"  # quarantine reason: the target cannot take this row's images
MEDIA_IN_TEXT = "media_token_in_text"  # quarantine reason: the text itself writes an image or video placeholder
# config.json keys of the token ids a vision-language target fills with vision features (Qwen2-VL/2.5-VL: image and
# video pads; Kimi-K2.5: <|media_pad|>, as vLLM's and SGLang's Kimi-K2.5 code read it)
MEDIA_TOKEN_KEYS = ("image_token_id", "video_token_id", "media_placeholder_token_id")
GRID_CACHE = 65536  # images whose patch grid a Vision remembers (a few MiB)


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation's image parts, in the order the chat template renders them."""
    return [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]


@dataclass
class Vision:
    """The target's image side: its image processor, placeholder token and merge size."""

    image_processor: Any
    placeholder: str
    image_token_id: int
    merge: int
    # sha256 -> patch grid of the images met so far, newest last: regenerate renders a conversation's images again
    # at every turn, and a dataset may hold one image many times; the grid is a function of the image's bytes.
    _grids: OrderedDict[str, list[int]] = field(default_factory=OrderedDict, repr=False)

    def expand(self, text: str, spans: list[tuple[int, int]], images: list[dict[str, Any]], pils=None):
        """(text with every placeholder expanded, the character spans moved with it, the row's image record),
        or Rejected when an image cannot be read as prepare read it. `pils`: the images, when already loaded."""
        if pils is None:
            pils = load_images(images)
            if isinstance(pils, Rejected):
                return pils
        grids = self.grids(images, pils)
        pieces = text.split(self.placeholder)
        if len(pieces) - 1 != len(images):
            return Rejected(
                UNSUPPORTED,
                f"the chat template rendered {len(pieces) - 1} {self.placeholder} for {len(images)} images",
            )
        counts = [t * h * w // self.merge**2 for t, h, w in grids]
        starts = [sum(map(len, pieces[: k + 1])) + k * len(self.placeholder) for k in range(len(images))]

        def moved(c: int) -> int:  # a character position of the rendered text, in the expanded text
            return c + sum(len(self.placeholder) * (n - 1) for s, n in zip(starts, counts, strict=True) if s < c)

        new = [pieces[0]]
        for n, piece in zip(counts, pieces[1:], strict=True):
            new += [self.placeholder * n, piece]
        record = {
            "images": [{"image": p["image"] if not p["image"].startswith("data:") else None, "sha256": p["sha256"]}
                       for p in images],
            "image_grid_thw": grids,
        }  # fmt: skip
        return "".join(new), [(moved(s), moved(e)) for s, e in spans], record

    def grids(self, images: list[dict[str, Any]], pils: list[Any]) -> list[list[int]]:
        """Each image's patch grid (t, h, w) as the image processor gives it; an image met before (its sha256) is
        not processed again. At most GRID_CACHE images are remembered."""
        todo = [k for k, p in enumerate(images) if p["sha256"] not in self._grids]
        if todo:
            out = self.image_processor(images=[pils[k] for k in todo])
            for k, g in zip(todo, out["image_grid_thw"], strict=True):
                self._grids[images[k]["sha256"]] = [int(x) for x in g]
        got = []
        for p in images:
            self._grids.move_to_end(p["sha256"])
            got.append(self._grids[p["sha256"]])
        while len(self._grids) > GRID_CACHE:
            self._grids.popitem(last=False)
        return got


def encode_with_images(encoder, messages: list[dict[str, Any]], tools: list[dict] | None):
    """ChatEncoder's path for a conversation with images: rendered as a text row is (the same mask source),
    each placeholder expanded, encoded; the loss mask then 0 on every image token. (ids, mask, record) or
    Rejected."""
    import jinja2

    if encoder._vision is None:
        encoder._vision = load_vision(encoder.model_path, encoder.tokenizer)
    vision = encoder._vision
    if isinstance(vision, str):
        return Rejected(UNSUPPORTED, vision)
    markers = encoder.mask_source == "generation_markers"
    try:
        if markers:
            from transformers.utils.chat_template_utils import render_jinja_template

            texts, spans = render_jinja_template(
                conversations=[messages], tools=tools, chat_template=encoder.template,
                return_assistant_tokens_mask=True, **encoder.template_kwargs,
            )  # fmt: skip
        else:
            texts, spans = encoder._boundary_spans([messages], tools)
            if isinstance(spans[0], Rejected):
                return spans[0]
    except jinja2.TemplateError as e:
        return Rejected("template_error", f"the chat template raised: {e}")
    got = vision.expand(texts[0], spans[0], image_parts(messages))
    if isinstance(got, Rejected):
        return got
    text, span, record = got
    enc = encoder.backend.encode(text, add_special_tokens=False)
    mask = marker_mask(enc, span) if markers else boundary_mask(enc, span)
    for i, token in enumerate(enc.ids):
        if token == vision.image_token_id:
            mask[i] = 0
    return enc.ids, mask, record


def media_token_ids(model_path: str | os.PathLike) -> dict[int, str]:
    """{token id: its config.json key} of the target's vision placeholders; {} for a text-only target."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # no config.json (a tokenizer-only folder): nothing here to fill with vision features
    return {config[k]: k for k in MEDIA_TOKEN_KEYS if isinstance(config.get(k), int)}


def media_in_text(ids: list[int], media: dict[int, str], allowed: int | None = None) -> Rejected | None:
    """Rejected when the row's ids hold a vision placeholder no image fills (`allowed`: the image token an
    image row's expansion wrote). The engine would stop the shard on it, after the GPU job started."""
    for k, token in enumerate(ids):
        if token in media and token != allowed:
            return Rejected(
                MEDIA_IN_TEXT,
                f"the text writes the target's vision placeholder {media[token]} = {token} at token {k}, "
                "with no image to fill it",
            )
    return None


def refuse_media_in_text(encoder, convs: list[dict[str, Any]], results: list, max_seq_len: int) -> list:
    """ChatEncoder's results with every row whose kept tokens (the first `max_seq_len`) write a vision placeholder
    of the target made Rejected (the image token stays allowed in a row with images, where the expansion wrote it)."""
    media = media_token_ids(encoder.model_path)
    if not media:  # a text-only target: no row is scanned
        return results
    image_token = getattr(encoder._vision, "image_token_id", None)
    return [
        r
        if isinstance(r, Rejected)
        else media_in_text(r[0][:max_seq_len], media, image_token if image_parts(c["messages"]) else None) or r
        for c, r in zip(convs, results, strict=True)
    ]


def images_refusal(config: dict[str, Any]) -> str | None:
    """Why the target of this config.json cannot take images (one line), None when tokenize can expand them.
    The parse (parse.check_model) and tokenize both ask it."""
    kind = config.get("model_type")
    if "image_token_id" not in config and "vision_config" not in config:
        return f"the target ({kind}) has no vision tower; list text-only sources, or a vision-language model.path"
    if kind not in EXPANDS:
        return f"tokenizing images for model_type {kind!r} is not implemented; known: {', '.join(EXPANDS)}"
    return None


def load_vision(model_path: str | os.PathLike, tokenizer) -> Vision | str:
    """The target's Vision, or why it cannot take images (one line, the quarantine detail)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"cannot read {model_path}/config.json ({e})"
    if refusal := images_refusal(config):
        return refusal
    kind = config["model_type"]
    from transformers import AutoImageProcessor

    image_processor = AutoImageProcessor.from_pretrained(model_path)
    placeholder = EXPANDS[kind]
    return Vision(
        image_processor, placeholder, tokenizer.convert_tokens_to_ids(placeholder),
        int(getattr(image_processor, "merge_size", 2)),
    )  # fmt: skip


def load_images(parts: list[dict[str, Any]]):
    """The parts' images as RGB PIL images (load_image), or the first one's Rejected."""
    pils = []
    for k, part in enumerate(parts):
        got = load_image(part, k)
        if isinstance(got, Rejected):
            return got
        pils.append(got)
    return pils


def collapse_runs(ids: list[int], token: int) -> list[int]:
    """`ids` with every run of `token` cut to one: expanded image placeholders, one an image again (what vLLM's
    processor takes: it expands each itself)."""
    return [t for k, t in enumerate(ids) if t != token or k == 0 or ids[k - 1] != token]


def load_image(part: dict[str, Any], k: int):
    """The k-th image as an RGB PIL image, or Rejected when it is gone or is not the image prepare hashed."""
    from PIL import Image

    ref = part["image"]
    try:
        data = data_uri_bytes(ref, f"image {k}") if ref.startswith("data:") else Path(ref).read_bytes()
    except OSError as e:
        return Rejected("image_missing", f"image {k}: {ref} cannot be read ({e.strerror}); re-run prepare")
    except PrepareRejected as e:
        return Rejected(e.reason, e.detail)
    if hashlib.sha256(data).hexdigest() != part["sha256"]:
        return Rejected("image_changed", f"image {k}: {ref} is not the image prepare read (sha256 differs)")
    img = Image.open(io.BytesIO(data))
    return img.convert("RGB")
