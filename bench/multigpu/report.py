"""The report of bench/multi_gpu.py: a run's table, every run of a config against its gpus=1 run, the
`report` scenario (the tables again from the run.json files) and the export of the small files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from multigpu.checks import TARGET_SHARE, limit_verdict
from multigpu.run import summarize

_PRINTED = [0]  # how many of the report's lines are on stdout already


def flush(lines: list[str]) -> None:
    """Print the lines added since the last flush: a long run shows each result as it comes."""
    for line in lines[_PRINTED[0] :]:
        print(line, flush=True)
    _PRINTED[0] = len(lines)


def fmt(x: float | None, spec: str = ",.0f") -> str:
    """A number for the tables, "-" for a missing one."""
    return "-" if x is None else format(x, spec)


def print_run(r: dict, out: list[str]) -> None:
    """One run's jobs as a table, then its aggregate, concurrency, nvidia-smi, host and validation lines."""
    t0 = min((j["started_at"] for j in r["jobs"]), default=0.0)
    out.append(f"\n### {r['run']} (--resources gpus={r['gpus_resource']}, tp_size {r['tp_size']}, {r['device']})")
    out.append(
        "| shard | GPUs (claimed) | job start s | capture s | end s | tokens | job tok/s | engine start s | valid |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    for j in sorted(r["jobs"], key=lambda j: j["started_at"]):
        out.append(
            f"| {j['shard']} | {','.join(j['gpus']) or '-'} ({j['claim_source']}) | {j['started_at'] - t0:.1f} | "
            f"{j['capture_started_at'] - t0:.1f} | {j['capture_ended_at'] - t0:.1f} | {j['tokens']:,} | "
            f"{fmt(j['tokens_per_s'])} | {j['engine_start_s']:.1f} | {r['validation_ok'].get(str(j['shard']))} |"
        )
    a, c, h = r["aggregate"], r["aggregate_capture"], r["host"]
    out.append(
        f"- aggregate: {a['tokens']:,} tokens in {a['span_s']:.1f} s (first job start to last capture end) = "
        f"**{fmt(a['tokens_per_s'])} tok/s**; captures alone {fmt(c['tokens_per_s'])} tok/s ({c['span_s']:.1f} s with "
        "at least one capture running)"
    )
    out.append(
        f"- jobs at once (GPU holds overlapping): at most {r['max_concurrent_jobs']}; GPU ids shared by overlapping "
        f"jobs: {r['gpu_conflicts'] or 'none'}; jobs without recorded GPU ids: {r['jobs_without_gpu_ids'] or 'none'}"
    )
    smi = r["nvidia_smi"]
    out.append(
        "- nvidia-smi: absent (CPU run), not sampled"
        if smi is None
        else f"- nvidia-smi during the captures ({smi['samples']} samples, busy = util >= {smi['threshold_util']} %): "
        f"at most {smi['max_busy_at_once']} GPUs busy at once; share of samples busy per GPU {smi['busy_share']}"
    )
    out.append(
        f"- host: RSS of Snakemake's process tree peak {h['rss_peak_bytes'] / 2**30:.1f} GiB (a sum over processes: "
        f"shared pages count once per process); host memory used peak {h['host_mem_used_peak_bytes'] / 2**30:.1f} of "
        f"{h['host_mem_total_bytes'] / 2**30:.0f} GiB; disk writes (host-wide) peak "
        f"{fmt(h['disk_write_peak_bps'] and h['disk_write_peak_bps'] / 1e9, '.2f')} GB/s, mean over the captures "
        f"{fmt(h['disk_write_mean_bps_capture'] and h['disk_write_mean_bps_capture'] / 1e9, '.2f')} GB/s; shard bytes "
        f"/ capture span {fmt(h['shard_bytes_per_s_capture'] and h['shard_bytes_per_s_capture'] / 1e9, '.2f')} GB/s; "
        f"worst share of a capture the forward waited for a host slot {fmt(h.get('writer_stall_share_max'), '.1%')}, "
        f"the writers for the disk {fmt(h.get('writer_disk_wait_share_max'), '.1%')}"
    )
    validated = (
        "skipped (--skip-validate)"
        if r.get("validation") == "skipped"
        else f"{r['all_validated']} (snakemake rc {r['validate_rc']}, {r['validate_wall_s']} s)"
    )
    out.append(
        f"- every shard extracted: {r['all_extracted']} (snakemake rc {r['snakemake_rc']}, "
        f"{r['snakemake_wall_s']} s); every shard validated ok: {validated}"
    )
    if r.get("error"):
        out.append(f"```\n{r['error']}\n```")
    if r.get("validate_error"):
        out.append(f"```\n{r['validate_error']}\n```")


def compare(out_dir: Path, config_key: str, lines: list[str], disk_bps: float | None = None) -> list[dict]:
    """Every run of this config in OUT against its gpus=1 run: ratio of aggregate tokens/s and the verdict."""
    runs = []
    for p in sorted(out_dir.glob("*/run.json")):
        r = json.loads(p.read_text())
        if r.get("config") == config_key and r.get("scenario") == "jobs":
            runs.append(r)
    singles = [r for r in runs if r["gpus_resource"] == 1 and r["all_extracted"]]
    lines.append(f"\n### jobs at once vs one ({config_key}; baseline: a gpus=1 run of the same shards)")
    lines.append(
        "| run | results on | gpus | max jobs at once | distinct GPUs | aggregate tok/s | vs gpus=1 | target "
        "| captures tok/s | vs gpus=1 | all valid | baseline | limit |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(runs, key=lambda r: (-r["gpus_resource"], r["run"])):
        # The baseline writes where this run writes (disk or /dev/shm) when such a run exists.
        base = next(
            (b for b in singles if b.get("results_on") == r.get("results_on")), singles[0] if singles else None
        )
        n = r["gpus_resource"] // r["tp_size"]
        want = TARGET_SHARE * n
        ratio = ratio_c = None
        if base and r["aggregate"]["tokens_per_s"] and base["aggregate"]["tokens_per_s"]:
            ratio = r["aggregate"]["tokens_per_s"] / base["aggregate"]["tokens_per_s"]
            ratio_c = r["aggregate_capture"]["tokens_per_s"] / base["aggregate_capture"]["tokens_per_s"]
        smi = r.get("nvidia_smi") or {}
        busy = smi.get("busy_share") or {}
        verdict = (
            f"CPU smoke: the jobs share this host's {os.cpu_count()} cores; not a GPU figure"
            if r["device"] == "cpu"
            else limit_verdict(
                ratio,
                want,
                r["host"]["shard_bytes_per_s_capture"],
                disk_bps or r.get("disk_probe_bps"),
                r["host"]["host_mem_used_peak_bytes"],
                r["host"]["host_mem_total_bytes"],
                (sum(busy.values()) / len(busy)) if busy else None,
                r["host"].get("writer_disk_wait_share_max"),
            )
        )
        valid = "skipped" if r.get("validation") == "skipped" else r["all_validated"]
        lines.append(
            f"| {r['run']} | {r.get('results_on') or 'OUT'} | {r['gpus_resource']} | {r['max_concurrent_jobs']} | "
            f"{not r['gpu_conflicts']} | {fmt(r['aggregate']['tokens_per_s'])} | {fmt(ratio, '.2f')} | {want:.2f} | "
            f"{fmt(r['aggregate_capture']['tokens_per_s'])} | {fmt(ratio_c, '.2f')} | {valid} | "
            f"{base['run'] if base else '-'} | {verdict} |"
        )
    if not singles:
        lines.append("(no gpus=1 run of this config in OUT yet: run the same command with --gpus 1)")
    return runs


def export_results(out: Path, dest: Path) -> int:
    """The small files of every run under `out` (summary, run.json, samples, Snakemake and job logs) into
    `dest`, the folder that comes back from the device; models, data and shards stay."""
    n = 0
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out)
        keep = rel.name in ("summary.md", "moe_prefill.json", "run.json", "samples.json") or (
            p.suffix == ".log" and ".snakemake" not in rel.parts
        )
        if p.is_file() and keep and not rel.parts[0].startswith(("model", "moe-model", "data")):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dest / rel)
            n += 1
    return n


def scenario_report(args, lines: list[str]) -> None:
    """The tables again from the run.json files under OUT (the derived figures recomputed from the
    samples by this code), or with --export the small files copied out."""
    if args.export:
        lines.append(f"exported {export_results(args.out, args.export)} files to {args.export}")
        return
    keys = set()
    for p in sorted(args.out.glob("*/run.json")):
        r = json.loads(p.read_text())
        if r.get("scenario") in ("jobs", "tp"):
            if (p.parent / "samples.json").exists():  # the derived figures by this code, from the raw facts
                summarize(r, json.loads((p.parent / "samples.json").read_text()))
            print_run(r, lines)
        if r.get("scenario") == "jobs":
            keys.add(r["config"])
    for key in sorted(keys):
        compare(args.out, key, lines)
