"""The report stage: an HTML report with plots, a CSV summary, and the dataset-level manifest."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from . import faults
from .atomic import atomic_open, sha256_file, write_json
from .shard import FORMAT, MANIFEST, TIMINGS, read_manifest

DATASET_FORMAT = "eagle3prep.dataset/1"


def _load(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _benchmark_seconds(path: str | Path) -> float | None:
    """Wall seconds from a Snakemake benchmark TSV (first column `s`); None when absent."""
    import pandas as pd

    if not Path(path).is_file():
        return None
    return float(pd.read_csv(path, sep="\t")["s"].iloc[-1])


def _row_stats(tokenized: list[str]):
    """Per row: shard, seq_len, share of loss-masked tokens."""
    import pandas as pd

    out = []
    for k, path in enumerate(tokenized):
        with open(path, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                out.append(
                    {"shard": k, "seq_len": r["seq_len"], "mask_share": sum(r["loss_mask"]) / max(r["seq_len"], 1)}
                )
    return pd.DataFrame(out, columns=["shard", "seq_len", "mask_share"])


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _plots(rows, summary, layer_norms: dict[str, list[float]]) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist(rows["seq_len"], bins=40)
    ax.set(xlabel="tokens per row", ylabel="rows", title="Sequence lengths")
    figs["Sequence lengths"] = _png(fig)

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist(rows["mask_share"], bins=40, range=(0, 1))
    ax.set(xlabel="share of tokens with loss_mask = 1", ylabel="rows", title="Loss-mask share")
    figs["Loss-mask share"] = _png(fig)

    fig, ax = plt.subplots(figsize=(6, 3))
    for layer, norms in sorted(layer_norms.items(), key=lambda kv: int(kv[0])):
        ax.plot(range(len(norms)), norms, marker="o", label=f"layer {layer}")
    ax.set(xlabel="shard", ylabel="mean token L2 norm", title="Per-layer hidden-state norms")
    ax.legend(fontsize=7)
    figs["Per-layer norms"] = _png(fig)

    fig, ax = plt.subplots(figsize=(6, 3))
    x = range(len(summary))
    ax.bar([i - 0.2 for i in x], summary["tokens_per_s"].fillna(0), width=0.4, label="capture (timings.json)")
    ax.bar(
        [i + 0.2 for i in x],
        summary["job_tokens_per_s"].fillna(0),
        width=0.4,
        label="whole job, engine start included (benchmark TSV)",
    )
    ax.set_xticks(list(x), summary["shard"].astype(str))
    ax.legend(fontsize=7)
    ax.set(xlabel="shard", ylabel="tokens/s", title="Extract throughput per shard")
    figs["Throughput"] = _png(fig)

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(summary["shard"].astype(str), summary["bytes"] / 2**20)
    ax.set(xlabel="shard", ylabel="MiB", title="Bytes on disk per shard")
    figs["Disk use"] = _png(fig)
    return figs


def build_report(
    validations: list[str],
    shard_dirs: list[str],
    tokenized: list[str],
    counts_path: str,
    stats_path: str,
    benchmarks: list[str],
    config: dict[str, Any],
    out_html: str,
    out_csv: str,
    out_manifest: str,
) -> dict[str, Any]:
    import pandas as pd

    counts, stats = _load(counts_path), _load(stats_path)
    manifests = [read_manifest(d) for d in shard_dirs]
    reports = [_load(v) for v in validations]
    rows = _row_stats(tokenized)

    records, layer_norms = [], {}
    for k, (d, m, v, bench) in enumerate(zip(shard_dirs, manifests, reports, benchmarks, strict=True)):
        timings = _load(Path(d) / TIMINGS) if (Path(d) / TIMINGS).is_file() else {}
        job_s = _benchmark_seconds(bench)
        worst = max((r["rel"] for r in v.get("reference", [])), default=None)
        records.append(
            {
                "shard": k,
                "rows": m["rows"],
                "tokens": m["tokens"],
                "bytes": sum(f["bytes"] for f in m["files"].values()),
                "job_s": job_s,
                "engine_start_s": timings.get("engine_start_s"),
                "tokens_per_s": timings.get("tokens_per_s"),  # capture only (timings.json)
                "job_tokens_per_s": m["tokens"] / job_s if job_s else None,  # whole job (benchmark TSV)
                "validation_ok": v["ok"],
                "reference_worst_rel": worst,
                "capture_path": m["engine"]["capture_path"],
            }
        )
        for layer, s in v.get("layer_stats", {}).items():
            layer_norms.setdefault(layer, []).append(s["mean_token_norm"])
    summary = pd.DataFrame(records)
    faults.kill_point("report.before_summary")
    with atomic_open(out_csv, "w", encoding="utf-8", newline="") as f:
        summary.to_csv(f, index=False)

    first = manifests[0]
    dataset = {
        "format": DATASET_FORMAT,
        "shard_format": FORMAT,
        "layer_ids": first["layer_ids"],
        "layer_id_convention": first["layer_id_convention"],
        "num_hidden_layers": first["num_hidden_layers"],
        "hidden_size": first["hidden_size"],
        "dtype": first["dtype"],
        "model": first["model"],
        "tokenizer": first["tokenizer"],
        "engine": first["engine"],
        "rows": int(summary["rows"].sum()),
        "tokens": int(summary["tokens"].sum()),
        "bytes": int(summary["bytes"].sum()),
        "shards": [
            {
                "shard": m["shard"],
                "dir": str(d),
                "rows": m["rows"],
                "tokens": m["tokens"],
                "row_range": m["row_range"],
                "manifest_sha256": sha256_file(Path(d) / MANIFEST),
            }
            for d, m in zip(shard_dirs, manifests, strict=True)
        ],
        "prepare": counts["totals"],
        "tokenize": {k: stats[k] for k in sorted(stats) if k != "shards"},
        "config": config,
    }
    mixed = {(m["dtype"], tuple(m["layer_ids"]), m["model"]["weights_sha256"]) for m in manifests}
    if len(mixed) > 1:
        raise ValueError(f"shards disagree on dtype/layer ids/model: {sorted(mixed)}; rerun the odd ones")
    faults.kill_point("report.before_manifest")
    write_json(out_manifest, dataset)

    figs = _plots(rows, summary, layer_norms)
    faults.kill_point("report.before_html")
    _write_html(out_html, dataset, summary, figs, counts, stats)
    return dataset


def _write_html(path: str, dataset: dict[str, Any], summary, figs: dict[str, str], counts: dict, stats: dict) -> None:
    esc = html.escape
    quarantined = {
        **{f"prepare: {k}": v for k, v in counts["totals"].get("quarantined", {}).items() if v},
        **{f"tokenize: {k}": v for k, v in stats.get("quarantined", {}).items() if v},
    }
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>eagle3prep report</title>",
        "<style>body{font-family:sans-serif;max-width:960px;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}</style></head><body>",
        "<h1>eagle3prep dataset report</h1>",
        f"<p>{dataset['rows']} rows, {dataset['tokens']} tokens, {dataset['bytes'] / 2**20:.1f} MiB in "
        f"{len(dataset['shards'])} shards. Layer ids {dataset['layer_ids']} ({esc(dataset['layer_id_convention'])}; "
        f"id {dataset['num_hidden_layers']} = pre-norm final state), dtype {esc(dataset['dtype'])}, "
        f"engine {esc(str(dataset['engine'].get('engine')))} {esc(str(dataset['engine'].get('engine_version')))} "
        f"via {esc(str(dataset['engine'].get('capture_path')))}.</p>",
        "<h2>Shards</h2>",
        summary.to_html(index=False, float_format=lambda x: f"{x:.4g}"),
        "<h2>Quarantined records</h2>",
        "<table>"
        + "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in sorted(quarantined.items()))
        + "</table>"
        if quarantined
        else "<p>none</p>",
    ]
    for title, png in figs.items():
        parts.append(f"<h2>{esc(title)}</h2><img alt='{esc(title)}' src='data:image/png;base64,{png}'>")
    parts.append("</body></html>")
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
