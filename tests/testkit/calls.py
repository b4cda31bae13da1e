"""The stages' inner calls with every config value a test does not name taken from the typed settings (config/
schema.yaml's defaults), as the stage's job entry passes them: a test names only what it varies.

- validate: validate_shard, with validate.* as keywords (`sample_rows=2`, `reference=False`).
- prepare, image_options: prepare with data.max_line_bytes and data.allow_no_user_turn as keywords; the images
  read under a root with data.max_image_pixels.
- tokenize: tokenize_conversations, with tokenize.* (`workers=1`, `template_fallback=False`) as keywords.

model.trust_remote_code is a keyword of validate and tokenize. A value a test names replaces the default as it is
(dataclasses.replace: an unknown key is a TypeError), unchecked against the schema's bounds, as a call would pass it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from eagle3prep.config import schema_default
from eagle3prep.settings import DataSettings, TokenizeSettings, ValidateSettings

PathLike = str | os.PathLike


def validate(
    shard: PathLike, tokenized: PathLike, out_json: PathLike, model: PathLike, *,
    trust_remote_code: bool = schema_default("model", "trust_remote_code"), refs=None,
    keep_failed: bool = schema_default("heal", "keep_failed"), **validate_keys: Any,
) -> dict[str, Any]:  # fmt: skip
    """validate_shard of `shard` against `tokenized` and `model`, its report written to `out_json`."""
    from eagle3prep.validate import validate_shard

    s = replace(ValidateSettings.defaults(), **validate_keys)
    return validate_shard(
        str(shard), str(tokenized), str(out_json), str(model),
        s.sample_rows, s.seed, s.device, s.reference, trust_remote_code, s.windows, refs=refs, keep_failed=keep_failed,
    )  # fmt: skip


def _data(**data_keys: Any) -> DataSettings:
    return replace(DataSettings.defaults(sources=["unused"]), **data_keys)  # sources: prepare's own argument


def image_options(root: PathLike | None = None, **data_keys: Any):
    """How prepare reads images: under `root` (None: the working directory), data.max_image_pixels unless given."""
    from eagle3prep.prepare.images import ImageOptions

    return ImageOptions(None if root is None else str(root), _data(**data_keys).max_image_pixels)


def prepare(
    sources: Sequence[PathLike], conversations: PathLike, quarantine: PathLike, counts: PathLike, *, images=None,
    allow_prompt_only: bool = False, **data_keys: Any,
) -> dict[str, Any]:  # fmt: skip
    """prepare of `sources` into the three outputs; `images`: image_options(...), None to quarantine images."""
    from eagle3prep.prepare import prepare

    d = _data(**data_keys)
    return prepare(
        list(sources), conversations, quarantine, counts, max_line_bytes=d.max_line_bytes,
        allow_no_user_turn=d.allow_no_user_turn, allow_prompt_only=allow_prompt_only, images=images,
    )  # fmt: skip


def tokenize(
    conversations: PathLike, model: PathLike, shards: Sequence[PathLike], stats: PathLike, token_freq: PathLike,
    quarantine: PathLike, max_seq_len: int, *, trust_remote_code: bool = schema_default("model", "trust_remote_code"),
    batch_size: int | None = None, **tokenize_keys: Any,
) -> dict[str, Any]:  # fmt: skip
    """tokenize_conversations of `conversations` with `model` into `shards`; returns the stats."""
    from eagle3prep.tokenize import tokenize_conversations

    s = replace(TokenizeSettings.defaults(), max_seq_len=max_seq_len, **tokenize_keys)
    batch = {} if batch_size is None else {"batch_size": batch_size}  # None: the package's own BATCH_SIZE
    return tokenize_conversations(
        conversations, model, list(shards), stats, token_freq, quarantine, s.max_seq_len,
        template_fallback=s.template_fallback, trust_remote_code=trust_remote_code, workers=s.workers,
        chat_template_kwargs=s.chat_template_kwargs, **batch,
    )  # fmt: skip
