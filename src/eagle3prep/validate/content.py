"""Content checks of an intact shard: token ids identical to the tokenized shard's, each layer file's
tensors as the manifest's storage lays them out, finite values, and per-layer statistics (DESIGN.md §6)."""

from __future__ import annotations

from typing import Any

from ..check import Checks
from ..infra import faults
from ..shard.formats import DTYPES
from ..shard.readers import LayerReader, read_token_ids
from .subject import ShardUnderTest

CHUNK_TOKENS = 65536  # rows of a layer file read at once for statistics (bounds memory)


def check_content(subject: ShardUnderTest, checks: Checks) -> dict[str, Any]:
    """Token identity, then each layer's layout and values: the report's `layer_stats` (layer id -> stats)."""
    check_token_ids(subject, checks)
    stats = {}
    for lid in subject.manifest.layer_ids:
        faults.kill_point("validate.mid_checks", shard=subject.dir.name, layer=lid)
        reader = subject.layer(lid)
        if not checks.add(f"shape:layer_{lid}", *layout_matches(reader, subject)):
            continue
        stats[str(lid)] = layer_stats(reader)
        nonfinite = stats[str(lid)]["nonfinite_tokens"]
        checks.add(f"finite:layer_{lid}", nonfinite == 0, f"{nonfinite} tokens with NaN/Inf" if nonfinite else "")
    return stats


def check_token_ids(subject: ShardUnderTest, checks: Checks) -> bool:
    import torch

    stored = read_token_ids(subject.dir)  # [sum_T] int64
    expected = torch.tensor([t for r in subject.rows for t in r["input_ids"]], dtype=torch.int64)
    same_shape = stored.shape == expected.shape
    return checks.add(
        "token_ids",
        same_shape and torch.equal(stored, expected),
        f"{int((stored != expected).sum()) if same_shape else 'shape'} tokens differ",
    )


def layout_matches(reader: LayerReader, subject: ShardUnderTest) -> tuple[bool, str]:
    """Every tensor of a layer file has the dtype and shape the manifest's storage gives it."""
    m = subject.manifest
    want = m.storage_format.tensors(m.tokens, m.hidden_size, m.dtype)
    have = reader.tensors()
    got = [(n, *have[n]) for n, _, _ in want if n in have]
    expected = [(n, DTYPES[d][0], list(shape)) for n, d, shape in want]
    ok = got == expected and sorted(have) == sorted(n for n, _, _ in want)
    describe = "; ".join(f"{n} {d}{s}" for n, d, s in got)
    return ok, f"{describe}, expected {'; '.join(f'{n} {d}{s}' for n, d, s in expected)} ({m.storage_name})"


def layer_stats(reader: LayerReader) -> dict[str, Any]:
    """Mean, std, mean token norm and max |x| over a layer's finite tokens (read in chunks, FP8 dequantized),
    and how many tokens hold NaN/Inf."""
    import torch

    tokens, hidden = reader.shape
    nonfinite, total, sq, norm_sum, max_abs = 0, 0.0, 0.0, 0.0, 0.0
    for a in range(0, tokens, CHUNK_TOKENS):
        x = reader.rows(a, a + CHUNK_TOKENS, torch.float32)  # [chunk, H]
        finite = torch.isfinite(x).all(dim=-1)  # [chunk]
        if not bool(finite.all()):
            nonfinite += int((~finite).sum())
            x = x[finite]
        total += float(x.sum())
        sq += float((x * x).sum())
        norm_sum += float(x.norm(dim=-1).sum())
        max_abs = max(max_abs, float(x.abs().max()) if x.numel() else 0.0)
    n = tokens * hidden
    mean = total / max(n, 1)
    return {
        "mean": mean,
        "std": max(sq / max(n, 1) - mean * mean, 0.0) ** 0.5,
        "mean_token_norm": norm_sum / max(tokens, 1),
        "max_abs": max_abs,
        "nonfinite_tokens": nonfinite,
    }
