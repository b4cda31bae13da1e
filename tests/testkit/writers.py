"""Test-only writers and references: what the tests and benches compare the stages' output with."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from eagle3prep.shard.formats import MODEL_DTYPE, SCALES_KEY, VALUES_KEY, storage_format
from eagle3prep.shard.layout import safetensors_header

if TYPE_CHECKING:
    import torch


def write_layer(path: str | os.PathLike, hidden: torch.Tensor, storage: str = MODEL_DTYPE) -> None:
    """A whole layer file from [T, H] states, in the streaming writers' layout (planted shards, tests).
    A scaled storage encodes `hidden` as the capture does; model_dtype stores it as it is."""
    import torch

    fmt = storage_format(storage)
    parts = fmt.encode(hidden.detach().contiguous())
    tensors = dict(zip((VALUES_KEY, SCALES_KEY), parts, strict=False))
    layout = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()]
    with open(path, "wb") as f:
        f.write(safetensors_header(layout, fmt.metadata(str(hidden.dtype).removeprefix("torch."))))
        for t in tensors.values():
            f.write(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())


def reference_logprobs_hf(model_dir, token_ids: list[int], dtype: str = "bfloat16"):
    """What a correct engine stores: a full transformers forward at `dtype`, fp32 log_softmax, [T-1]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids]), use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0]
