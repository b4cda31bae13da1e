"""The plan's numbers: what the extract jobs will write and how long they will take, before any of them runs.

From the tokenized shards' sizes (results/tokenized/stats.json) and the model's shape: the bytes each
hidden-state shard will take (extract.shard_bytes, the same estimate the extract job checks against
free space), the total, the free space on the output filesystem, and, when a throughput is configured
(plan.tokens_per_s), each job's time and a shard size that keeps engine start-up under 5 % of it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..extract import free_space_probe, shard_bytes
from ..infra.atomic import atomic_open, write_json
from ..infra.units import compact_duration, human_bytes
from ..shard.formats import StorageFormat, storage_format, storage_of_entry
from ..shard.layout import MANIFEST

START_SHARE = 0.05  # engine start-up should stay under this share of a shard's job time
TIMES = ("job_hours_total", "job_hours_left", "gpu_hours_left", "start_share_worst", "recommended")


@dataclass(slots=True)
class ShardPlan:
    shard: int
    rows: int
    tokens: int
    bytes: int  # extract.shard_bytes: layer files + token ids + index + manifest
    done: bool  # a manifest is there, of this config's capture: its bytes are on disk, not still to be written
    job_s: float | None  # engine start + tokens / tokens_per_s; None without a throughput
    redo: str | None = None  # why a finished shard there is extracted again (another config made it)


def min_tokens_per_shard(tokens_per_s: float, engine_start_s: float, share: float = START_SHARE) -> int:
    """Smallest shard whose capture time makes start-up at most `share` of the job:
    start / (start + tokens / tps) <= share  <=>  tokens >= start * tps * (1 - share) / share."""
    return math.ceil(engine_start_s * tokens_per_s * (1 - share) / share)


def make_plan(
    shard_sizes: list[dict[str, int]],
    num_layers: int,
    hidden_size: int,
    dtype: str,
    hidden_states_dir: str | os.PathLike,
    *,
    tokens_per_s: float | None,
    engine_start_s: float,
    storage: StorageFormat,
    gpus_per_job: int = 1,
    made_with: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The plan as a JSON-able dict.

    Args:
        shard_sizes: [{"shard", "rows", "tokens"}] per tokenized shard (stats.json's "shards").
        num_layers, hidden_size, dtype: what each token stores (len(layer ids) x H in `dtype`).
        hidden_states_dir: results/hidden_states; finished shards there are marked done, and its
            filesystem (or its nearest existing parent's) is the one whose free space counts.
        tokens_per_s: tokens/s of one extract job once its engine is up (a finished shard's
            timings.json has it); None leaves the time estimate and the shard size out.
        engine_start_s: seconds from job start to the first batch (model load, engine start-up).
        gpus_per_job: GPUs one extract job holds (tp_size for vllm, 1 for hf on cuda, 0 on cpu).
        storage: extract.storage's format (shard/formats.py): its bytes per token.
        made_with: what this config's shards hold ({"layer_ids", "dtype", "storage", "model_path", "tokenized"}, the
            tokenized folder): a finished shard that differs, or is older than the tokenized shards, is not done,
            as the workflow extracts it again (shard_state); None: every shard with a manifest is done.
    """
    out = Path(hidden_states_dir)
    shards = [
        _shard_plan(s, out, num_layers, hidden_size, dtype, storage, tokens_per_s, engine_start_s, made_with)
        for s in shard_sizes
    ]
    probe = free_space_probe(out.resolve())
    free = shutil.disk_usage(probe).free
    to_write = sum(s.bytes for s in shards if not s.done)
    total_tokens = sum(s.tokens for s in shards)
    plan: dict[str, Any] = {
        "shards": [asdict(s) for s in shards],
        "num_shards": len(shards),
        "rows": sum(s.rows for s in shards),
        "tokens": total_tokens,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "dtype": dtype,
        "storage": storage.name,
        "bytes_total": sum(s.bytes for s in shards),
        "bytes_to_write": to_write,
        "largest_shard_bytes": max((s.bytes for s in shards), default=0),
        # More shards than rows: the last ones are empty (valid, but each extract job still starts an engine).
        "empty_shards": [s.shard for s in shards if not s.rows],
        "output_dir": str(out),
        "free_space_path": str(probe),
        "free_bytes": free,
        "fits": to_write <= free,
        "tokens_per_s": tokens_per_s,
        "engine_start_s": engine_start_s,
        "gpus_per_job": gpus_per_job,
        **dict.fromkeys(TIMES),  # None without a throughput; _times fills them in
    }
    if tokens_per_s:
        plan.update(_times(shards, tokens_per_s, engine_start_s, gpus_per_job))
    return plan


def _shard_plan(size: dict[str, int], out: Path, num_layers: int, hidden_size: int, dtype: str, storage: StorageFormat,
                tokens_per_s: float | None, engine_start_s: float,
                made_with: dict[str, Any] | None) -> ShardPlan:  # fmt: skip
    """One shard's plan from its stats.json entry; done when its folder has a manifest of this config's capture."""
    k, tokens = int(size["shard"]), int(size["tokens"])
    job_s = engine_start_s + tokens / tokens_per_s if tokens_per_s else None
    done, redo = shard_state(out / f"shard_{k}", made_with)
    return ShardPlan(
        shard=k,
        rows=int(size["rows"]),
        tokens=tokens,
        bytes=shard_bytes(tokens, int(size["rows"]), num_layers, hidden_size, dtype, storage),
        done=done,
        job_s=round(job_s, 1) if job_s is not None else None,
        redo=redo,
    )


def shard_state(folder: Path, made_with: dict[str, Any] | None) -> tuple[bool, str | None]:
    """(done, why it is extracted again): a shard is done when its manifest is there and records what this config
    captures (layer ids, dtype, storage, model folder) from the tokenized shards as they are now (its manifest is
    newer than them), the checks Snakemake's params and dates make; `made_with` None checks the manifest alone."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return False, None
    if made_with is None:
        return True, None
    try:
        m = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False, f"its {MANIFEST} does not read"
    if not isinstance(m, dict):
        return False, f"its {MANIFEST} is not a manifest"
    made = {
        "layer_ids": m.get("layer_ids"),
        "dtype": m.get("dtype"),
        "storage": storage_of_entry(m.get("storage")),
        "model_path": (m.get("model") or {}).get("path"),
    }
    differ = [f"{key} {made[key]} (now {made_with[key]})" for key in made if made[key] != made_with[key]]
    if differ:
        return False, "made with " + ", ".join(differ)
    if made_with.get("redo"):  # the plan tokenized this config's shards itself: results/'s are another config's
        return False, made_with["redo"]
    tokenized = Path(made_with["tokenized"])
    stamp = next((p for p in (tokenized / ".snakemake_timestamp", tokenized / "stats.json") if p.is_file()), None)
    if stamp is not None and stamp.stat().st_mtime_ns > manifest.stat().st_mtime_ns:
        return False, "older than the tokenized shards"
    return True, None


def _times(shards: list[ShardPlan], tokens_per_s: float, engine_start_s: float, gpus_per_job: int) -> dict[str, Any]:
    """The plan's time estimate and recommended shard size, given a throughput."""
    left = [s.job_s for s in shards if not s.done]
    times: dict[str, Any] = {
        "job_hours_total": round(sum(s.job_s for s in shards) / 3600, 3),
        "job_hours_left": round(sum(left) / 3600, 3),
        "gpu_hours_left": round(sum(left) * gpus_per_job / 3600, 3),
    }
    smallest = min(shards, key=lambda s: s.tokens, default=None)
    if smallest is not None:
        times["start_share_worst"] = round(engine_start_s / smallest.job_s, 4) if smallest.job_s else None
    min_tokens = min_tokens_per_shard(tokens_per_s, engine_start_s)
    times["recommended"] = {
        "max_start_share": START_SHARE,
        "min_tokens_per_shard": min_tokens,
        # On average; shards are even in rows, not tokens, so the smallest may fall a little short.
        "max_num_shards": max(1, sum(s.tokens for s in shards) // max(min_tokens, 1)),
    }
    return times


def format_plan(plan: dict[str, Any], num_shards_key: str = "tokenize.num_shards") -> str:
    """The plan as a short table and a few sentences (.eagle3prep/plan/plan.txt)."""
    lines = _table(plan) + _disk(plan, num_shards_key) + _validation_memory(plan) + _time(plan, num_shards_key)
    lines += plan.get("bill_lines", [])
    return "\n".join(lines) + "\n"


def _table(plan: dict[str, Any]) -> list[str]:
    """The plan's first line (what each token stores) and one line per shard."""
    fmt = storage_format(plan["storage"])
    lines = [
        f"eagle3prep plan: {_shards(plan['num_shards'])}, {plan['rows']:,} rows, {plan['tokens']:,} tokens; "
        f"each token stores {plan['num_layers']} layers x hidden {plan['hidden_size']} in "
        + (fmt.summary if fmt.scaled else plan["dtype"]),
        "",
        f"{'shard':>5}  {'rows':>9}  {'tokens':>13}  {'bytes':>10}  {'job time':>9}  status",
    ]
    for s in plan["shards"]:
        job = compact_duration(s["job_s"]) if s["job_s"] is not None else "-"
        status = "done (has manifest)" if s["done"] else f"to redo: {s['redo']}" if s.get("redo") else "to do"
        lines.append(
            f"{s['shard']:>5}  {s['rows']:>9,}  {s['tokens']:>13,}  {human_bytes(s['bytes']):>10}  {job:>9}  {status}"
        )
    return lines


def _disk(plan: dict[str, Any], num_shards_key: str) -> list[str]:
    """Whether the shards fit, and the empty shards' line when there are some."""
    verdict = "fits" if plan["fits"] else "DOES NOT FIT: free space or point results/ at a larger filesystem"
    lines = [
        "",
        f"disk: {human_bytes(plan['bytes_total'])} in all, {human_bytes(plan['bytes_to_write'])} still to write "
        f"(largest shard {human_bytes(plan['largest_shard_bytes'])}); {human_bytes(plan['free_bytes'])} free on "
        f"{plan['free_space_path']} -> {verdict}",
    ]
    if plan["empty_shards"]:
        lines.append(
            f"empty shards: {len(plan['empty_shards'])} of {plan['num_shards']} hold no rows ({plan['rows']:,} rows "
            f"for {plan['num_shards']} shards); they start no engine and validate, but each is still a job; "
            f"set {num_shards_key} to {max(plan['rows'], 1)} or fewer to avoid them"
        )
    return lines


def _validation_memory(plan: dict[str, Any]) -> list[str]:
    """What the scalable reference loads, when the plan has it."""
    mem = plan.get("validation_memory")
    if mem and "error" not in mem:
        a, b = mem["largest_window"] or ("-", "-")
        return [
            f"validate, reference scalable: the logits check loads {human_bytes(mem['logits_bytes'])} (final norm + "
            f"lm_head); the largest window ({a} -> {b}) {human_bytes(mem['window_bytes'])} of layers at bf16, one "
            f"layer at a time: peak {human_bytes(mem['layer_peak_bytes'])}"
        ]
    if mem:
        return [f"validate, reference scalable: memory unknown ({mem['error']})"]
    return []


def _time(plan: dict[str, Any], num_shards_key: str) -> list[str]:
    """Job time and the recommended shard size, or how to get them."""
    if not plan["tokens_per_s"]:
        return [
            "time: set plan.tokens_per_s (tokens/s of one extract job; a finished shard's timings.json and the "
            "report show it) for job time and a recommended shard size"
        ]
    rec = plan["recommended"]
    return [
        f"time: {plan['job_hours_left']:.2f} job-hours left"
        + (
            f" ({plan['gpu_hours_left']:.2f} GPU-hours at {plan['gpus_per_job']} GPU{'s' * (plan['gpus_per_job'] != 1)} "
            "per job)"
            if plan["gpus_per_job"]
            else " (on CPU)"
        )
        + f", {plan['job_hours_total']:.2f} for every shard, at {plan['tokens_per_s']:,} tokens/s and "
        f"{plan['engine_start_s']:g} s engine start-up per job",
        f"shard size: start-up stays under {rec['max_start_share']:.0%} of a job with at least "
        f"{rec['min_tokens_per_shard']:,} tokens per shard, i.e. at most {_shards(rec['max_num_shards'])} for "
        f"{plan['tokens']:,} tokens; now {num_shards_key} = {plan['num_shards']}, whose smallest shard spends "
        f"{plan['start_share_worst']:.1%} of its time starting up"
        + (" (fewer shards would waste less)" if plan["num_shards"] > rec["max_num_shards"] else ""),
    ]


def _shards(n: int) -> str:
    return f"{n} shard" + "s" * (n != 1)


def write_plan(plan: dict[str, Any], json_path: str | os.PathLike, txt_path: str | os.PathLike) -> str:
    write_json(json_path, plan)
    text = format_plan(plan)
    with atomic_open(txt_path, "w", encoding="utf-8") as f:
        f.write(text)
    return text


def shard_sizes_from_stats(stats_path: str | os.PathLike) -> list[dict[str, int]]:
    """[{"shard", "rows", "tokens"}] from the tokenize stage's stats.json (exact; written with the shards)."""
    with open(stats_path, encoding="utf-8") as f:
        stats = json.load(f)
    return [{"shard": s["shard"], "rows": s["rows"], "tokens": s["tokens"]} for s in stats["shards"]]
