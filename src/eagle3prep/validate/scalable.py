"""validate.reference: scalable (DESIGN.md §6), for targets too large for a full reference forward: the
window checks (window.py) and the logits check (logits.py) on one shard, and what they need in memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..check import Checks
from ..tokenize.row_inputs import RowImages
from .logits import HEAD_CHUNK, check_logits
from .slices import Checkpoint, hf_config, raw_config
from .subject import ShardUnderTest
from .window import check_windows


def validate_scalable(
    subject: ShardUnderTest, model_path: str, picks: list[int], windows: list[list[int]] | None, checks: Checks
) -> dict[str, Any]:
    """The window checks on the sampled rows `picks` (default window: the last two captured ids) and the
    logits check on the rows whose prompt logprobs the engine stored; their verdicts go to `checks`."""
    ids = subject.manifest.layer_ids
    windows = windows if windows is not None else ([ids[-2:]] if len(ids) >= 2 else [])
    images = RowImages(model_path, subject.shard.tokenized)  # rows with images run at their 3-D rope positions
    positions = [images.positions(subject.rows[i]) if subject.rows[i].get("images") else None for i in picks]
    out: dict[str, Any] = {"windows": check_windows(subject, model_path, picks, windows, positions, checks)}
    out["logits"] = check_logits(subject, model_path, checks)
    return out


def check_memory(model, layer_ids: list[int], windows: list[tuple[int, int]] | None) -> dict[str, Any]:
    """Bytes the two checks need, from config.json shapes alone (the module tree built on the meta device).

    logits: final norm + lm_head in fp32 plus their bf16 copy and one chunk of fp32 logits.
    window: the largest window's decoder-layer parameters at bf16 after dequantization (what it reads);
    layer_peak: the largest single layer held at bf16 and upcast to fp32 at once (run_window's peak).
    `windows` defaults to consecutive pairs of `layer_ids`.
    """
    if isinstance(model, Checkpoint):
        config = model.config
    elif isinstance(model, dict):
        config = hf_config(model.get("text_config", model))
    else:
        config = hf_config(raw_config(Path(model)))
    skel = _skeleton_only(config)
    n = config.num_hidden_layers
    windows = windows or list(zip(layer_ids[:-1], layer_ids[1:], strict=False))
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in skel.model.layers]
    head = sum(p.numel() for p in skel.model.norm.parameters()) + skel.lm_head.weight.numel()
    sizes = {(a, b): 2 * sum(per_layer[a:b]) for a, b in windows}
    largest = max(sizes, key=sizes.get) if sizes else None
    return {
        "num_hidden_layers": n,
        "logits_bytes": 6 * head + 4 * HEAD_CHUNK * config.vocab_size,
        "window_bytes": sizes[largest] if largest else 0,
        "largest_window": list(largest) if largest else None,
        "layer_peak_bytes": max((6 * per_layer[k] for a, b in windows for k in range(a, b)), default=0),
        "windows": {f"{a}->{b}": v for (a, b), v in sizes.items()},
    }


def _skeleton_only(config):
    import torch
    from transformers import AutoModelForCausalLM

    from .slices import text_skeleton

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:  # a VLM's text config (slices.Checkpoint.skeleton)
            return text_skeleton(config)
