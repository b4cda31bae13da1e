"""The report stage: an HTML report, a CSV summary (one row per shard) and the dataset-level manifest.

data.py gathers what the page shows, plots.py draws it, page.py lays it out; this module reads the
workflow's outputs and writes the three files (DESIGN.md §6).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from ..infra import faults
from ..infra.atomic import atomic_open, sha256_file, write_json
from ..shard.layout import MANIFEST, TIMINGS
from ..shard.shardset import ShardSet
from ..shard.tokenized import rows as tokenized_rows
from . import data, page, plots, samples, stale

DATASET_FORMAT = "eagle3prep.dataset/1"


def _benchmark_seconds(path: str | Path) -> float | None:
    """Wall seconds from a Snakemake benchmark TSV (first column `s`); None when absent."""
    import pandas as pd

    if not Path(path).is_file():
        return None
    return float(pd.read_csv(path, sep="\t")["s"].iloc[-1])


def _row_stats(tokenized: list[str]):
    """Per row: shard, seq_len, share of loss-masked tokens (for the length and mask histograms), images."""
    import pandas as pd

    out = []
    for k, path in enumerate(tokenized):
        for r in tokenized_rows(path):
            out.append(
                {"shard": k, "seq_len": r["seq_len"], "mask_share": sum(r["loss_mask"]) / max(r["seq_len"], 1),
                 "images": len(r.get("images", ()))}
            )  # fmt: skip
    return pd.DataFrame(out, columns=["shard", "seq_len", "mask_share", "images"])


def _summary(shard_dirs, manifests, reports, benchmarks, margins):
    import pandas as pd

    records = []
    for k, (d, m, v, bench) in enumerate(zip(shard_dirs, manifests, reports, benchmarks, strict=True)):
        timings = data.load_json(Path(d) / TIMINGS) if (Path(d) / TIMINGS).is_file() else {}
        job_s = _benchmark_seconds(bench)
        worst = max((r["rel"] for r in v.get("reference") or []), default=None)
        shard_margins = [vals[k] for vals in margins.values() if vals[k] is not None]
        records.append(
            {
                "shard": k,
                "rows": m.rows,
                "tokens": m.tokens,
                "bytes": sum(f["bytes"] for f in m.files.values()),
                "job_s": job_s,
                "engine_start_s": timings.get("engine_start_s"),
                "tokens_per_s": timings.get("tokens_per_s"),  # capture only (timings.json)
                "job_tokens_per_s": m.tokens / job_s if job_s else None,  # whole job (benchmark TSV)
                "validation_ok": v["ok"],
                "reference_worst_rel": worst,
                "reference_worst_margin": max(shard_margins) if shard_margins else None,  # error / bound
                "capture_path": m.engine["capture_path"],
            }
        )
    return pd.DataFrame(records)


def _export_facts(export_dir: str | None) -> dict[str, Any] | None:
    """Rows and bytes of the speculators export, from its manifest; None when it was not requested."""
    if not export_dir:
        return None
    m = data.load_json(Path(export_dir) / MANIFEST)
    return {"dir": str(export_dir), "rows": m["rows"], "bytes": sum(f["bytes"] for f in m["files"].values())}


def _dataset_manifest(shard_dirs, manifests, summary, counts, stats, reports) -> dict[str, Any]:
    mixed = {(m.dtype, m.storage_name, tuple(m.layer_ids), m.model["weights_sha256"]) for m in manifests}
    if len(mixed) > 1:
        raise ValueError(f"shards disagree on dtype/storage/layer ids/model: {sorted(mixed)}; rerun the odd ones")
    first = manifests[0]
    return {
        "format": DATASET_FORMAT,
        "shard_format": first.format,
        **({"storage": first.storage} if first.storage else {}),
        **{
            k: getattr(first, k)
            for k in ("layer_ids", "layer_id_convention", "num_hidden_layers", "hidden_size", "dtype")
        },
        **{k: getattr(first, k) for k in ("model", "tokenizer")},
        # The engine that captured rows: an empty shard (more shards than rows) starts none.
        "engine": next((m.engine for m in manifests if m.rows), first.engine),
        "rows": int(summary["rows"].sum()),
        "tokens": int(summary["tokens"].sum()),
        "bytes": int(summary["bytes"].sum()),
        "shards": [
            {
                "shard": m.shard,
                "dir": str(d),
                "rows": m.rows,
                "tokens": m.tokens,
                "row_range": m.row_range,
                "manifest_sha256": sha256_file(Path(d) / MANIFEST),
            }
            for d, m in zip(shard_dirs, manifests, strict=True)
        ],
        "prepare": data.prepared_counts(counts)["totals"],
        "tokenize": {k: stats[k] for k in sorted(stats) if k != "shards"},
        # What the config decided is recorded by the stages themselves (sources in counts.json,
        # max_seq_len in stats.json, engine and layers in the shard manifests, the reference check
        # in the validation files): the report takes no config, so no config edit reruns it.
        "sources": data.prepared_counts(counts).get("sources"),
        "reference": data.reference_summary(reports),
        # with regenerate.enabled: the stage's totals and each regenerated shard's manifest sha256
        **(
            {"regenerate": {"totals": counts["totals"], "shard_manifests": counts.get("shard_manifests")}}
            if counts.get("stage") == "regenerate"
            else {}
        ),
    }


@dataclass(frozen=True, slots=True)
class ReportPaths:
    """The report job's files: every shard's outputs and the run's counts in, the three files out."""

    validations: Sequence[str]
    shard_dirs: Sequence[str]
    tokenized: Sequence[str]
    counts_path: str  # prepare's counts.json, or the regenerate stage's
    stats_path: str
    token_freq_path: str
    benchmarks: Sequence[str]  # the extract jobs' benchmark TSVs (a missing one leaves its cells empty)
    out_html: str
    out_csv: str
    out_manifest: str
    export_dir: str | None = None  # the speculators export when it was requested (the report records it)
    overfit_gate: str | None = None  # the gate's JSON when validate.overfit_gate is on (its verdict is a banner)
    model_dir: str | None = None  # whose tokenizer renders the sample rows (None: they show token ids)
    failed_dir: str | None = None  # results/failed/, whose set-aside shard copies the report lists in red


@dataclass(frozen=True, slots=True)
class ReportJobSettings:
    """None, on purpose: what the config decided is in the report's inputs (counts, stats, manifests,
    validations), so a config edit reruns the report only through the jobs it reruns."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        return cls()


def run_report_job(paths: ReportPaths, settings: ReportJobSettings) -> dict[str, Any]:
    """The report stage's job: summary.csv, dataset_manifest.json and report.html written (in that order); the
    manifest returned."""
    validations, shard_dirs, tokenized = list(paths.validations), list(paths.shard_dirs), list(paths.tokenized)
    counts_path, stats_path, failed_dir = paths.counts_path, paths.stats_path, paths.failed_dir
    counts, stats = data.load_json(counts_path), data.load_json(stats_path)
    manifests = [s.manifest for s in ShardSet.open(shard_dirs, tokenized).check(final_layer=False).shards]
    reports = [data.load_json(v) for v in validations]
    margins = data.reference_margins(reports)

    summary = _summary(shard_dirs, manifests, reports, list(paths.benchmarks), margins)
    faults.kill_point("report.before_summary")
    with atomic_open(paths.out_csv, "w", encoding="utf-8", newline="") as f:
        summary.to_csv(f, index=False)

    dataset = _dataset_manifest(shard_dirs, manifests, summary, counts, stats, reports)
    faults.kill_point("report.before_manifest")
    write_json(paths.out_manifest, dataset)

    outlier_note, series = _layer_series(shard_dirs, reports)
    row_stats = _row_stats(tokenized)
    coverage = data.vocab_coverage(data.load_json(paths.token_freq_path))
    ctx = _page_context(dataset, stats, counts, reports, summary, margins, row_stats, coverage)
    ctx.update(_quarantine_context(counts, stats, counts_path, stats_path))
    ctx["set_aside"] = stale.set_aside_shards(failed_dir) if failed_dir else []
    ctx.update(outlier_note=outlier_note, code_versions={str(m.code_version) for m in manifests},
               export=_export_facts(paths.export_dir),
               overfit_gate=data.load_json(paths.overfit_gate) if paths.overfit_gate else None)  # fmt: skip
    # The tokenizer the rows were made with (trust_remote_code as the shards recorded it).
    tokenizer, ctx["samples_note"] = samples.load_tokenizer_or_reason(
        paths.model_dir, bool(dataset["model"].get("trust_remote_code"))
    )
    ctx["samples"] = samples.samples(tokenized, tokenizer, max_seq_len=stats.get("max_seq_len"))
    figs = _figures(margins, series, coverage, summary, row_stats, stats, len(reports))
    faults.kill_point("report.before_html")
    page.write_page(paths.out_html, ctx, figs)
    return dataset


def _layer_series(shard_dirs: list[str], reports: list[dict[str, Any]]) -> tuple[str, Any]:
    """The per-layer statistics' series, with outlier shares from validation when it counted every token
    (sampled from the shards otherwise), and the note that says which."""
    exact = all("outlier_share" in s for v in reports for s in v.get("layer_stats", {}).values())
    outliers = None if exact else [data.sampled_outlier_shares(d, v) for d, v in zip(shard_dirs, reports, strict=True)]
    ratio = data.OUTLIER_NORM_RATIO
    outlier_note = (
        f"Outlier token: L2 norm above {ratio:g}x the layer's mean token norm in the shard; "
        + ("share over every token (validation)." if exact else
           f"share over up to {data.OUTLIER_SAMPLE_TOKENS:,} sampled tokens per layer and shard.")
    )  # fmt: skip
    return outlier_note, data.layer_stat_series(reports, outliers)


def _quarantine_context(counts: dict[str, Any], stats: dict[str, Any], counts_path: str, stats_path: str) -> dict:
    """Rows lost per source file and the tool-call quarantine, from the quarantine.jsonl beside each stage's counts
    (prepare's or the regenerate stage's beside counts.json, tokenize's beside stats.json)."""
    later = {"tokenize": data.quarantine_facts(Path(stats_path).parent / "quarantine.jsonl")}
    beside_counts = Path(counts_path).parent / "quarantine.jsonl"
    if counts.get("stage") == "regenerate":
        later = {"regenerate": data.quarantine_facts(beside_counts), **later}
        prepare = {}  # prepare's quarantine is not among the report's inputs then: its counts say enough
    else:  # prepare's file holds every bad raw record: only its tool-call lines are read
        prepare = {"prepare": data.quarantine_facts(beside_counts, reasons=("invalid_tool_call",))}
    return {
        "source_losses": data.source_losses(counts, later),
        "tool_quarantine": data.tool_quarantine(counts, stats, {**prepare, **later}),
    }


def _page_context(dataset, stats, counts, reports, summary, margins, row_stats, coverage) -> dict[str, Any]:
    """What the page shows of the run's outputs (run_report_job adds the rest)."""
    skipped = [k for k, v in enumerate(reports) if data.reference_skipped(v)]
    return {
        "dataset": dataset,
        "stats": stats,
        "counts": counts,
        "reports": reports,
        "summary": summary,
        "margins": margins,
        "funnel": data.funnel(counts, stats),
        "images": data.image_facts(counts, stats, row_stats["images"].tolist()),
        "grid": data.check_grid(reports),
        "coverage": coverage,
        "reference_skipped": skipped,
        "reference_line": data.reference_summary(reports) + (f"; SKIPPED on shards {skipped}" if skipped else ""),
    }


def _figures(margins, series, coverage, summary, row_stats, stats, n: int) -> dict[str, Any]:
    """The page's figures, by the name page.py places them under."""
    return {
        "margin": plots.reference_margin(margins, n) if margins else None,
        "layer_stats": plots.layer_stats(series, n),
        "coverage": plots.vocab_coverage(coverage),
        "throughput": plots.throughput_and_disk(summary),
        "distributions": plots.distributions(row_stats, stats.get("max_seq_len"), stats.get("truncated_rows", 0)),
    }


__all__ = ["DATASET_FORMAT", "ReportJobSettings", "ReportPaths", "run_report_job"]
