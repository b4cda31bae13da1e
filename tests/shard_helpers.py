"""Small hidden-state shards for tests: hand-made tokenized rows, captured with the hf backend on the demo model."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from eagle3prep.backends.base import CaptureSpec

DEMO_LAYER_IDS = [2, 4, 5, 8]  # the default [2, N//2, N-3, N] of the 8-layer demo model


def write_tokenized(path: Path, lengths: list[int], seed: int, first_row: int = 0) -> Path:
    """A tokenized shard (DESIGN.md §3) of random demo-vocabulary tokens, one row per length."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i, n in enumerate(lengths):
            ids = [rng.randrange(3, 512) for _ in range(n)]
            mask = [0] * (n // 2) + [1] * (n - n // 2)
            rid = hashlib.sha256(json.dumps([seed, ids]).encode()).hexdigest()[:32]
            row = {"row": first_row + i, "id": rid, "input_ids": ids, "loss_mask": mask, "seq_len": n}
            f.write(json.dumps(row) + "\n")
    return path


def demo_spec(model_dir: Path, dtype: str = "bfloat16") -> CaptureSpec:
    return CaptureSpec(backend="hf", model_path=str(model_dir), layer_ids=DEMO_LAYER_IDS, dtype=dtype)
