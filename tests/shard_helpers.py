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


def manifest_fields(**kw):
    """The fields of a ShardManifest that ShardWriter.finish() takes from its caller, as placeholders."""
    fields = {
        "shard": 0,
        "layer_id_convention": "input_of_layer",
        "num_hidden_layers": 8,
        "hidden_size": 4,
        "dtype": "float32",
        "row_range": [0, 0],
        "tokenized": {},
        "model": {},
        "tokenizer": {},
        "engine": {},
        "code_version": "",
    }
    return {**fields, **kw}


def capture_rows(backend, rows, batches=None):
    """Rows through backend.capture_shard() into a throw-away shard (the production write path), read
    back as {layer_id: [sum_T, H]}; `batches` splits `rows` into forward batches (default: one)."""
    import tempfile

    from safetensors.torch import load_file

    from eagle3prep.model_facts import ModelFacts
    from eagle3prep.shard.format import layer_file
    from eagle3prep.shard.sink import SinkSpec

    batches = batches or [rows]
    offsets = [sum(len(r) for r in rows[:i]) for i in range(len(rows))]
    with tempfile.TemporaryDirectory(prefix="e3p-test-") as tmp:
        spec = SinkSpec(
            layer_paths={lid: str(Path(tmp) / layer_file(lid)) for lid in backend.spec.layer_ids},
            hidden_size=ModelFacts.read(backend.spec.model_path).hidden_size,
            dtype=backend.spec.dtype,
            rows=[(o, len(r)) for o, r in zip(offsets, rows, strict=True)],
            step_tokens=max(sum(len(r) for r in b) for b in batches),
        )
        backend.capture_shard(iter(batches), spec)
        return {lid: load_file(p)["hidden_states"] for lid, p in spec.layer_paths.items()}
