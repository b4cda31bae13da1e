"""Small hidden-state shards for tests: hand-made tokenized rows, captured with the hf backend on the demo model."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from pathlib import Path

from eagle3prep.backends.base import CaptureSpec
from eagle3prep.settings import ExtractSettings

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


def capture_spec(
    backend: str, model_path: str, layer_ids: list[int], *, dtype: str, device: str, tp_size: int, max_seq_len: int,
    trust_remote_code: bool = False, settings: ExtractSettings | None = None,
) -> CaptureSpec:  # fmt: skip
    """One capture of `model_path`: `settings` (the schema's defaults if None) with the engine keys given."""
    engine = {"backend": backend, "dtype": dtype, "device": device, "tp_size": tp_size}
    settings = settings or ExtractSettings.defaults()
    settings = dataclasses.replace(settings, content=dataclasses.replace(settings.content, **engine))
    return CaptureSpec(settings, model_path, list(layer_ids), max_seq_len, trust_remote_code)


def with_settings(spec: CaptureSpec, settings: ExtractSettings | None = None, **content) -> CaptureSpec:
    """`spec` under `settings` (its own if None), keeping its engine keys (backend, dtype, device, tp_size), with the
    extract.content keys `content` on top."""
    settings = settings or spec.settings
    engine = {k: getattr(spec.settings.content, k) for k in ("backend", "dtype", "device", "tp_size")}
    settings = dataclasses.replace(settings, content=dataclasses.replace(settings.content, **{**engine, **content}))
    return dataclasses.replace(spec, settings=settings)


def demo_spec(model_dir: Path, dtype: str = "bfloat16") -> CaptureSpec:
    """The hf backend on the CPU, the demo model's default layer ids."""
    return capture_spec("hf", str(model_dir), DEMO_LAYER_IDS, dtype=dtype, device="cpu", tp_size=1, max_seq_len=2048)


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
    from eagle3prep.shard.layout import layer_file
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
            slots=3,
            tag_prefix="row",
        )
        backend.capture_shard(iter(batches), spec)
        return {lid: load_file(p)["hidden_states"] for lid, p in spec.layer_paths.items()}


def write_shard_of(tokenized: Path, shard_dir: Path, model_dir: Path, layer_ids: list[int], seed: int = 0) -> Path:
    """A finished shard folder for the rows of `tokenized` with random bf16 hidden states written by the test
    writer, no engine run: for rows the capture cannot take yet (images, issue #28 item 3, in another branch)
    that the stages after it must carry. Its manifest lists every file, so validation's file checks pass."""
    import torch
    from safetensors.torch import save_file

    from eagle3prep.infra.atomic import sha256_file
    from eagle3prep.infra.provenance import model_identity, tokenizer_identity
    from eagle3prep.layers import CONVENTION
    from eagle3prep.model_facts import ModelFacts
    from eagle3prep.shard.layout import INDEX, MANIFEST, TOKEN_IDS, layer_file
    from eagle3prep.shard.manifest import ShardManifest

    from testkit.writers import write_layer

    rows = [json.loads(line) for line in tokenized.read_text(encoding="utf-8").splitlines()]
    facts = ModelFacts.read(str(model_dir))
    shard_dir.mkdir(parents=True, exist_ok=True)
    index, offset = [], 0
    for r in rows:
        index.append({"row": r["row"], "id": r["id"], "offset": offset, "length": r["seq_len"]})
        offset += r["seq_len"]
    gen = torch.Generator().manual_seed(seed)
    for lid in layer_ids:
        write_layer(shard_dir / layer_file(lid), torch.randn(offset, facts.hidden_size, generator=gen).bfloat16())
    ids = torch.tensor([t for r in rows for t in r["input_ids"]], dtype=torch.int64)
    save_file({"token_ids": ids}, shard_dir / TOKEN_IDS)
    (shard_dir / INDEX).write_text(json.dumps(index))
    names = [*map(layer_file, layer_ids), TOKEN_IDS, INDEX]
    files = {n: {"sha256": sha256_file(shard_dir / n), "bytes": (shard_dir / n).stat().st_size} for n in names}
    manifest = ShardManifest(
        **manifest_fields(
            layer_id_convention=CONVENTION, num_hidden_layers=facts.num_hidden_layers, dtype="bfloat16",
            hidden_size=facts.hidden_size, row_range=[rows[0]["row"], rows[-1]["row"] + 1] if rows else [0, 0],
            tokenized={"path": str(tokenized), "sha256": sha256_file(tokenized)},
            model=model_identity(str(model_dir), False), tokenizer=tokenizer_identity(str(model_dir)),
            engine={"engine": "test writer", "capture_path": "random states (tests/testkit/shards.py)", "tp_size": 1},
        ),
        layer_ids=list(layer_ids), rows=len(rows), tokens=offset, files=files,
    )  # fmt: skip
    (shard_dir / MANIFEST).write_text(json.dumps(manifest.to_json()))
    return shard_dir
