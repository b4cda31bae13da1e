"""The whole bill of a run, for the `plan` target: every byte it will leave under results/ (what is there already,
the hidden-state shards still to write, the speculators export's copy of them, the shards set aside under
results/failed/, the small outputs) and the time of each stage, from what finished shards measured where they
exist (their timings.json and benchmark files), else from the config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..extract import shard_bytes
from ..infra.units import human_bytes, human_duration
from ..shard.formats import storage_format

RESULTS = "results"
# Made by the run beside the shards, per shard and per run (validation JSON, the report's three files, the export's
# manifests): on the demo (3 shards) the report took 260 KiB and each validation 14 KiB; bounds with room, since
# they do not grow with the hidden states.
SMALL_PER_SHARD = 32 * 2**10
SMALL_PER_RUN = 512 * 2**10
# Nominal rates of the validation estimate given before any shard is validated (the plan labels it an estimate, and
# a shard's measured benchmarks/validate/shard_k.tsv replaces it): a transformers forward costs 2 FLOPs a parameter a
# token, run at NOMINAL_FLOPS (50 GFLOP/s: a CPU host's cores in float32/bfloat16 matmuls; 100 TFLOP/s: a third of
# an H100's dense bfloat16 peak, what an unbatched eager forward gets), after reading the weights it loads and
# the shard's every byte (checksums) at NOMINAL_READ_BPS.
NOMINAL_FLOPS = {"CPU": 5e10, "GPU": 1e14}
NOMINAL_READ_BPS = 1e9
EXPORT_ROW_BYTES = 64  # the export's arrow part per row: ids, offsets, lengths (its tokens are counted apart)
EXPORT_TOKEN_BYTES = 9  # int64 input id and one loss-mask byte a token in the arrow part


def du(path: str | os.PathLike) -> int:
    """Bytes of the files under `path` (its blocks, as `du` counts them); 0 when it does not exist."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            total += st.st_blocks * 512
    return total


def _tsv_seconds(path: Path) -> float | None:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        return float(lines[-1].split("\t")[0])
    except (OSError, ValueError, IndexError):
        return None


def measured(shards: list[dict[str, Any]], hidden_states: str | os.PathLike,
             benchmarks: str | os.PathLike = "benchmarks") -> dict[str, Any]:  # fmt: skip
    """What finished shards measured: extract tokens/s and engine start (timings.json), validation seconds per
    shard (benchmarks/validate/shard_k.tsv), over the shards that have them."""
    rates, starts, validate_s = [], [], []
    for s in shards:
        k = s["shard"]
        try:
            t = json.loads((Path(hidden_states) / f"shard_{k}" / "timings.json").read_text(encoding="utf-8"))
            if t.get("tokens_per_s") and s["tokens"]:
                rates.append(float(t["tokens_per_s"]))
                starts.append(float(t.get("engine_start_s") or 0))
        except (OSError, ValueError):
            pass
        if (v := _tsv_seconds(Path(benchmarks) / "validate" / f"shard_{k}.tsv")) is not None:
            validate_s.append(v)
    avg = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {
        "extract_shards": len(rates),
        "tokens_per_s": round(avg(rates), 1) if rates else None,
        "engine_start_s": round(avg(starts), 1) if starts else None,
        "validate_shards": len(validate_s),
        "validate_s_per_shard": round(avg(validate_s), 1) if validate_s else None,
    }


def disk(plan: dict[str, Any], export_copy: bool, results: str | os.PathLike = RESULTS) -> dict[str, int]:
    """Every byte results/ will hold after the run: what is there now outside the shards, the shards, the export's
    copy of them (export.hidden_states: copy), the set-aside shards, and the small outputs still to write."""
    results = Path(results)
    hidden = Path(plan["output_dir"])
    there = du(results) - du(hidden) - du(results / "export") - du(results / "failed") - du(results / "plan")
    shards_b = plan["bytes_total"]
    export_b = 0
    if export_copy:
        copy = storage_format(plan["storage"]).export_copy  # as the shards store it, or decoded where speculators must
        per = [
            shard_bytes(s["tokens"], s["rows"], plan["num_layers"], plan["hidden_size"], plan["dtype"], copy)
            for s in plan["shards"]
        ]
        export_b = sum(per) + plan["rows"] * EXPORT_ROW_BYTES + plan["tokens"] * EXPORT_TOKEN_BYTES
    small = SMALL_PER_RUN + SMALL_PER_SHARD * plan["num_shards"]
    bill = {
        "already_there": max(there, 0),
        "hidden_states": shards_b,
        "export_copy": export_b,
        "set_aside": du(results / "failed"),
        "small_outputs": small,
    }
    bill["total"] = sum(bill.values())
    return bill


def model_weights(model_path: str | os.PathLike) -> tuple[int, int] | None:
    """(parameters, bytes) of a model folder's *.safetensors weights, from their headers (a few KiB read each);
    None when there are none or one cannot be read."""
    import struct

    params = size = 0
    files = sorted(Path(model_path).glob("*.safetensors"))
    try:
        for f in files:
            with open(f, "rb") as fh:
                header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
            for name, t in header.items():
                if name != "__metadata__":
                    n = 1
                    for d in t["shape"]:
                        n *= d
                    params += n
            size += f.stat().st_size
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return (params, size) if files else None


def validate_estimate(plan: dict[str, Any], weights: tuple[int, int] | None, sample_rows: int | str, mode: str,
                      device: str) -> float | None:  # fmt: skip
    """Seconds the validation of the shards still to extract would take at the nominal rates (see NOMINAL_FLOPS),
    before any shard is validated: per shard, the sampled rows' tokens (validate.sample_rows; auto as the pass rule
    picks them) through the weights the reference loads (all of them for full, the logits check and the largest
    window for scalable, none for off), plus reading those weights and the shard's bytes. None without weights."""
    from ..validate.passrule import rows_to_sample

    if weights is None and mode != "off":
        return None
    params, weight_bytes = weights or (0, 0)
    if mode == "scalable":
        mem = plan.get("validation_memory") or {}
        if "logits_bytes" not in mem:
            return None
        weight_bytes = mem["logits_bytes"] + mem["window_bytes"]
        params = weight_bytes // 2  # bfloat16 slices
    elif mode == "off":
        params = weight_bytes = 0
    rate = NOMINAL_FLOPS["GPU" if device.startswith("cuda") else "CPU"]
    total = 0.0
    for s in (s for s in plan["shards"] if not s["done"]):
        rows = s["rows"]
        picked = (rows_to_sample(rows) if sample_rows == "auto" else min(int(sample_rows), rows)) if rows else 0
        tokens = picked * s["tokens"] / rows if rows else 0
        total += 2 * params * tokens / rate + (weight_bytes + s["bytes"]) / NOMINAL_READ_BPS
    return total


def time_lines(plan: dict[str, Any], meas: dict[str, Any], validate_device: str, reference: bool,
               estimate_s: float | None = None) -> list[str]:  # fmt: skip
    """Each stage's time still to spend, and on what, with where each rate comes from."""
    left = [s for s in plan["shards"] if not s["done"]]
    tokens_left = sum(s["tokens"] for s in left)
    gpus = plan["gpus_per_job"]
    where = f"GPU ({gpus} per job)" if gpus else "CPU"
    if meas["tokens_per_s"]:
        rate, start = meas["tokens_per_s"], meas["engine_start_s"] or plan["engine_start_s"]
        source = f"measured on {meas['extract_shards']} finished shard{'s' * (meas['extract_shards'] != 1)}"
    elif plan["tokens_per_s"]:
        rate, start, source = plan["tokens_per_s"], plan["engine_start_s"], "plan.tokens_per_s"
    else:
        rate = None
    if rate:
        hours = (tokens_left / rate + start * sum(1 for s in left if s["rows"])) / 3600
        extract = (
            f"extract: {hours:.2f} h on {where} for {len(left)} shard{'s' * (len(left) != 1)} "
            f"({tokens_left:,} tokens at {rate:,.0f} tokens/s, {source})"
        )
    else:
        extract = (
            f"extract: {tokens_left:,} tokens on {where}; time unknown until one shard finishes (its timings.json "
            "has tokens/s) or plan.tokens_per_s is set"
        )
    vwhere = "GPU" if validate_device.startswith("cuda") else "CPU"
    ref = "with its reference forward" if reference else "without the reference forward (validate.reference off)"
    if meas["validate_s_per_shard"]:
        validate = (
            f"validate: {meas['validate_s_per_shard'] * len(left) / 3600:.2f} h on {vwhere} for {len(left)} "
            f"shard{'s' * (len(left) != 1)} {ref} ({meas['validate_s_per_shard']:g} s a shard, measured on "
            f"{meas['validate_shards']} validated shard{'s' * (meas['validate_shards'] != 1)})"
        )
    elif estimate_s is not None:
        validate = (
            f"validate: ~{human_duration(estimate_s)} on {vwhere} for {len(left)} shard{'s' * (len(left) != 1)} {ref} "
            f"(an estimate at nominal rates, {NOMINAL_FLOPS[vwhere] / 1e12:g} TFLOP/s and "
            f"{NOMINAL_READ_BPS / 1e9:g} GB/s reads, from the model's parameters and the sampled rows' tokens; "
            "a validated shard's measured time replaces it: snakemake results/validation/shard_0.json)"
        )
    else:
        validate = (
            f"validate: {len(left)} shard{'s' * (len(left) != 1)} on {vwhere} {ref}; time unknown until one shard is "
            "validated (snakemake results/validation/shard_0.json measures it)"
        )
    return [extract, validate]


def disk_line(bill: dict[str, int], free: int, logs_now: int = 0) -> str:
    parts = [
        f"{human_bytes(bill[k])} {label}"
        for k, label in (("already_there", "there now (prepared, tokenized, model)"),
                         ("hidden_states", "hidden-state shards"), ("export_copy", "export copy"),
                         ("set_aside", "set aside in results/failed"), ("small_outputs", "validation, report, logs"))
        if bill[k]
    ]  # fmt: skip
    verdict = "fits" if bill["total"] - bill["already_there"] <= free else "DOES NOT FIT"
    logs = f"; beside it, logs/ and benchmarks/ hold {human_bytes(logs_now)} now" if logs_now else ""
    return f"whole run: {human_bytes(bill['total'])} under results/ ({', '.join(parts)}) -> {verdict}{logs}"
