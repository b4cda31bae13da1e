"""The validate stage: is a hidden-state shard complete, intact, and the right numbers? (DESIGN.md §6)"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from . import faults
from .atomic import write_json
from .backends.vllm.compat import KNOWN_BUGS, NO_WORKAROUNDS_ENV, parse_version
from .config import reference_mode
from .errors import UserError
from .gpus import claim_job_gpus
from .passrule import describe_failure, judge_layer, judge_row, miss_probability, rows_to_sample
from .reference import ReferencePair
from .shard.layout import DTYPES, FP8_E4M3, TOKEN_IDS, layer_file, layer_tensors
from .shard.manifest import ShardManifest, check_listed_file, read_manifest, stray_files
from .shard.readers import LayerReader
from .shard.shardset import Shard, open_shard, shard_checks
from .tokenization.row_inputs import RowImages

CHUNK_TOKENS = 65536  # rows of a layer file read at once for statistics (bounds memory)


class ValidationError(UserError, RuntimeError):
    """A shard failed a check; the message lists which, `failed` holds their names."""

    failed: list[str] = []  # noqa: RUF012 - set per instance when raised


class Checks:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def add(self, name: str, ok: bool, detail: str = "") -> bool:
        self.items.append({"check": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [c for c in self.items if not c["ok"]]


def _read_tokenized(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _check_files(shard: Path, manifest: ShardManifest, checks: Checks) -> bool:
    ok = True
    for name, entry in sorted(manifest.files.items()):
        ok &= checks.add(f"file:{name}", *check_listed_file(shard / name, entry))
    stray = stray_files(shard, set(manifest.files))
    ok &= checks.add("no_stray_files", not stray, f"unexpected files: {stray}" if stray else "")
    ok &= checks.add("layer_files", *manifest.layer_files_match())
    return ok


def _check_index(shard: Shard, checks: Checks) -> bool:
    """The index against the tokenized shard it was captured from (shardset.shard_checks)."""
    ok = True
    for c in shard_checks(shard):
        ok &= checks.add(c.name, c.ok, c.detail)
    return ok


def _check_tensors(shard: Path, manifest: ShardManifest, rows: list[dict[str, Any]], checks: Checks) -> dict[str, Any]:
    import torch
    from safetensors import safe_open

    with safe_open(shard / TOKEN_IDS, framework="pt") as f:
        stored = f.get_tensor("token_ids")  # [sum_T] int64
    expected = torch.tensor([t for r in rows for t in r["input_ids"]], dtype=torch.int64)
    checks.add(
        "token_ids",
        stored.shape == expected.shape and torch.equal(stored, expected),
        f"{int((stored != expected).sum()) if stored.shape == expected.shape else 'shape'} tokens differ",
    )
    stats = {}
    for lid in manifest.layer_ids:
        faults.kill_point("validate.mid_checks", shard=shard.name, layer=lid)
        reader = LayerReader(shard / layer_file(lid))
        if not checks.add(f"shape:layer_{lid}", *_layout_matches(reader, manifest)):
            continue
        shape = reader.shape
        nonfinite, total, sq, norm_sum, max_abs = 0, 0.0, 0.0, 0.0, 0.0
        bad_rows: set[int] = set()
        for a in range(0, shape[0], CHUNK_TOKENS):
            x = reader.rows(a, a + CHUNK_TOKENS, torch.float32)  # [chunk, H], FP8 dequantized
            finite = torch.isfinite(x).all(dim=-1)  # [chunk]
            if not bool(finite.all()):
                nonfinite += int((~finite).sum())
                bad_rows.update((a + torch.nonzero(~finite).flatten()).tolist())
                x = x[finite]
            total += float(x.sum())
            sq += float((x * x).sum())
            norm_sum += float(x.norm(dim=-1).sum())
            max_abs = max(max_abs, float(x.abs().max()) if x.numel() else 0.0)
        checks.add(f"finite:layer_{lid}", nonfinite == 0, f"{nonfinite} tokens with NaN/Inf" if nonfinite else "")
        n = shape[0] * shape[1]
        mean = total / max(n, 1)
        stats[str(lid)] = {
            "mean": mean,
            "std": max(sq / max(n, 1) - mean * mean, 0.0) ** 0.5,
            "mean_token_norm": norm_sum / max(shape[0], 1),
            "max_abs": max_abs,
            "nonfinite_tokens": nonfinite,
        }
    return stats


def _layout_matches(reader: LayerReader, manifest: ShardManifest) -> tuple[bool, str]:
    """Every tensor of a layer file has the dtype and shape the manifest's storage gives it."""
    from safetensors import safe_open

    want = layer_tensors(manifest.storage_name, manifest.tokens, manifest.hidden_size, manifest.dtype)
    with safe_open(reader.path, framework="pt") as f:
        keys = sorted(f.keys())
        got = [(n, f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n, _, _ in want if n in keys]
    expected = [(n, DTYPES[d][0], list(shape)) for n, d, shape in want]
    ok = got == expected and keys == sorted(n for n, _, _ in want)
    describe = "; ".join(f"{n} {d}{s}" for n, d, s in got)
    return ok, f"{describe}, expected {'; '.join(f'{n} {d}{s}' for n, d, s in expected)} ({manifest.storage_name})"


def _sample(n_rows: int, sample_rows: int | str, seed: int) -> list[int]:
    """Row positions to recompute: `auto` = enough for passrule.MISS_RATE (all rows of a small shard)."""
    n = rows_to_sample(n_rows) if sample_rows == "auto" else min(int(sample_rows), n_rows)
    return sorted(random.Random(seed).sample(range(n_rows), n))


def _layer_summary(mine: list[dict[str, Any]]) -> dict[str, Any]:
    """Per layer over the sampled rows: failures, the worst error against its bound, diverged shares."""
    # Each row has its own bound (its floor run's error): the worst row is the one nearest its bound,
    # and the largest error may sit on another row with a wider bound.
    worst = max(mine, key=lambda r: r["rel"] / r["bound_rel"])
    largest = max(mine, key=lambda r: r["rel"])
    tokens = sum(r["tokens"] for r in mine) or 1
    return {
        "rows": len(mine),
        "failed_rows": sum(not r["ok"] for r in mine),
        "max_rel": largest["rel"],
        "max_rel_row": largest["row"],
        "worst_rel": worst["rel"],
        "bound_rel": worst["bound_rel"],
        "worst_margin": worst["rel"] / worst["bound_rel"],
        "worst_row": worst["row"],
        "cascade_rows": sum(r["cascade"] for r in mine),
        "tie_rows": sum(r["tie"] for r in mine),
        "diverged_share": sum(r["diverged"] for r in mine) / tokens,
        "floor_diverged_share": sum(r["floor_diverged"] for r in mine) / tokens,
    }


def _check_reference(
    shard: Shard,
    rows: list[dict[str, Any]],
    refs: ReferencePair,
    picks: list[int],
    checks: Checks,
    images: RowImages,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Recompute the `picks` rows (a row with images with its processor's pixels) and judge every layer of
    each (passrule.judge_row)."""
    import torch

    index, manifest = shard.index, shard.manifest
    dtype, lids, fp8 = manifest.dtype, manifest.layer_ids, manifest.storage_name == FP8_E4M3
    results = []
    files = {lid: LayerReader(shard.dir / layer_file(lid)) for lid in lids}
    for i in picks:
        e = index[i]
        pixels = images.image_inputs(rows[i]) if rows[i].get("images") else None
        want, floor = refs.rows(rows[i]["input_ids"], lids, pixels)
        for lid in lids:
            got = files[lid].rows(e.offset, e.offset + e.length, torch.float32)  # [T, H], FP8 dequantized
            margins = refs.margins(rows[i]["input_ids"], lid, pixels)  # near-ties of the MoE layers before lid
            verdict = judge_row(got, want[lid], floor[lid] if floor else None, dtype, fp8, margins)
            results.append({"row": e.row, "layer_id": lid, **verdict})
    summary = {}
    hint = known_engine_bug(manifest)
    for lid in lids:
        mine = [r for r in results if r["layer_id"] == lid]
        if not mine:
            continue
        judge_layer(mine)
        summary[str(lid)] = s = _layer_summary(mine)
        failed = [r for r in mine if not r["ok"]]
        if failed:
            floor = refs.describe() + (", shard stored as FP8" if fp8 else "")
            detail = f"{len(failed)} of {len(mine)} rows fail; first: {describe_failure(failed[0], dtype, floor)}"
            detail += f"; {hint}" if hint else ""
        else:
            detail = reference_ok_detail(s)
        checks.add(f"reference:layer_{lid}", not failed, detail)
    return results, summary


def reference_ok_detail(s: dict[str, Any]) -> str:
    """A passed layer's line. Every figure says what it is measured on: a row's error is the RMS over its
    tokens of |captured - reference| / |reference|; the worst row is the one nearest its own bound."""
    largest = (
        f"; largest error of any row {s['max_rel']:.3g} (row {s['max_rel_row']}, a wider bound)"
        if s.get("max_rel_row") is not None and s["max_rel_row"] != s["worst_row"]
        else ""
    )
    return (
        f"{s['rows']} rows ok; nearest its bound: row {s['worst_row']}, error {s['worst_rel']:.3g} = "
        f"{s['worst_margin']:.2f} x its bound {s['bound_rel']:.3g} (passes below 1; error = RMS over the row's "
        f"tokens of |captured - reference| / |reference|){largest}; "
        f"diverged tokens {s['diverged_share']:.2%} of all sampled (floor run {s['floor_diverged_share']:.2%}); "
        f"routing cascades in {s['cascade_rows']} rows ({s['tie_rows']} at a router near-tie)"
    )


def known_engine_bug(manifest: ShardManifest) -> str:
    """The known engine bug (compat.KNOWN_BUGS) that fits this shard's engine and was not worked around."""
    engine = manifest.engine
    if engine.get("engine") != "vllm":
        return ""
    archs = engine.get("architectures") or manifest.model.get("architectures") or []
    version = parse_version(engine.get("engine_version", "0"))
    for bug in KNOWN_BUGS:
        if bug.applies(version, engine.get("platform") == "cpu", archs) and bug.name not in engine.get(
            "workarounds", []
        ):
            return (
                f"known engine bug {bug.name} was not worked around when this shard was captured: {bug.why}; "
                f"recapture with the workaround on (unset {NO_WORKAROUNDS_ENV})"
            )
    return ""


def validate_shard(
    shard_dir: str,
    tokenized_shard: str,
    out_json: str,
    model_path: str,
    sample_rows: int | str = "auto",
    seed: int = 0,
    device: str = "cpu",
    reference: bool | str = True,
    trust_remote_code: bool = False,
    refs: ReferencePair | None = None,
    windows: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Run every check, write the report to `out_json`, raise ValidationError if any failed.

    `refs`: a ReferencePair already loaded (the validation matrix judges many shards of one model).
    """
    checks = Checks()
    report: dict[str, Any] = {"shard_dir": str(shard_dir), "tokenized": str(tokenized_shard)}
    try:
        m = read_manifest(shard_dir)
        checks.add("manifest", True)
    except (FileNotFoundError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        checks.add("manifest", False, str(e))
        m = None
    if m is not None:
        report.update(
            shard=m.shard, rows=m.rows, tokens=m.tokens, dtype=m.dtype, layer_ids=m.layer_ids, engine=m.engine
        )
        rows = _read_tokenized(tokenized_shard)
        # Content checks only make sense on intact files (index.json's sha256 included); a corrupt shard stops here.
        if _check_files(Path(shard_dir), m, checks) and _check_index(
            shard := open_shard(shard_dir, tokenized_shard), checks
        ):
            report["layer_stats"] = _check_tensors(shard.dir, m, rows, checks)
            mode = reference_mode(reference)
            report["reference_mode"] = mode
            picks = _sample(len(rows), sample_rows, seed) if mode != "off" else []
            report["reference_sample"] = {
                "rows": len(picks),
                "of": len(rows),
                "miss_probability": miss_probability(len(rows), len(picks)) if rows else 0.0,
            }
            if picks and not checks.failed and mode == "scalable":
                from .scalable import validate_scalable

                report["scalable"] = validate_scalable(shard, rows, model_path, picks, windows, checks)
            elif picks and not checks.failed:
                with claim_job_gpus(1 if device.startswith("cuda") and refs is None else 0):
                    refs = refs or ReferencePair(model_path, m.dtype, device, trust_remote_code)
                    report["reference_floor"] = refs.describe()
                    report["reference"], report["reference_layers"] = _check_reference(
                        shard, rows, refs, picks, checks, RowImages(model_path, tokenized_shard)
                    )
    report["checks"] = checks.items
    report["ok"] = not checks.failed
    faults.kill_point("validate.before_report", shard=Path(shard_dir).name)
    write_json(out_json, report)
    for c in checks.items:
        print(f"[validate] {'ok  ' if c['ok'] else 'FAIL'} {c['check']}: {c['detail']}", file=sys.stderr)
    if checks.failed:
        Path(out_json).unlink()  # a failed shard must not leave a report that looks like a pass
        names = ", ".join(f"{c['check']} ({c['detail']})" for c in checks.failed[:5])
        error = ValidationError(f"{shard_dir}: {len(checks.failed)} check(s) failed: {names}")
        error.failed = [c["check"] for c in checks.failed]
        raise error
    return report


__all__ = ["ValidationError", "validate_shard"]
