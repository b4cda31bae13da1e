"""The report's figures as base64 PNGs: each sized for a 1,000-pixel-wide page, shards on integer
ticks, legends beside the axes (never over the data)."""

from __future__ import annotations

import base64
import io
from typing import Any

WIDTH_IN = 9.6  # at DPI, the width of the page's text column
DPI = 100


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> str:
    buf = io.BytesIO()
    # tight: the image grows to hold every label and legend, so none is cut at the canvas's edge.
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", pad_inches=0.06)
    _pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _shard_axis(ax, n: int) -> None:
    """Shard numbers are integers: at most ~20 labelled ticks, never 0.5."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=min(max(n, 1), 20), integer=True))
    ax.set_xlim(-0.5, max(n - 0.5, 0.5))
    ax.set_xlabel("shard")


def _legend_outside(ax) -> None:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)


MARKERS = "os^Dv<>p"


def coinciding(series: dict[str, list[float | None]], digits: int = 3, tol: float = 0.0) -> list[list[str]]:
    """Groups of layers whose values agree on every shard (to `digits` significant digits, or within `tol`):
    their lines would draw as one."""

    def same(a: list[float | None], b: list[float | None]) -> bool:
        return all(
            (x is None) == (y is None)
            and (x is None or float(f"{x:.{digits}g}") == float(f"{y:.{digits}g}") or abs(x - y) <= tol)
            for x, y in zip(a, b, strict=True)
        )

    groups: list[list[str]] = []
    for lid, values in series.items():  # each layer joins the first group it agrees with on every member
        group = next((g for g in groups if all(same(values, series[m]) for m in g)), None)
        if group is None:
            groups.append([lid])
        else:
            group.append(lid)
    return [g for g in groups if len(g) > 1]


DODGE = 0.07  # shards apart: layers with equal values drawn side by side, within one shard's slot
# Reference margins closer than this share of the axis's height draw as one line at the figure's size (about 3 px
# of its 2.4 inches): such layers are drawn side by side too.
NEAR = 0.02
# Axes that start at 0 start this share of their height below it: a marker at 0 (a capture equal to its reference,
# no outlier token) is drawn whole, not cut in half by the axis as if there were no data.
BELOW_ZERO = 0.05


def _series(ax, series: dict[str, list[float | None]], label: str, tol: float = 0.0) -> list[list[str]]:
    """One line per layer, each its own marker; layers with equal values (within `tol`) are moved apart along
    x (by DODGE) so each stays visible. Returns those groups, for a note in the legend."""
    groups = coinciding(series, tol=tol)
    shift = {lid: (j - (len(g) - 1) / 2) * DODGE for g in groups for j, lid in enumerate(g)}
    for i, (lid, values) in enumerate(series.items()):
        xs = [k for k, v in enumerate(values) if v is not None]
        ax.plot(
            [k + shift.get(lid, 0.0) for k in xs],
            [values[k] for k in xs],
            marker=MARKERS[i % len(MARKERS)],
            ms=7 - i % 4,
            alpha=0.85,
            label=f"{label} {lid}",
        )
    return groups


def _equal_note(ax, groups: list[list[str]], series: dict[str, list[float | None]]) -> None:
    """A legend line per group of equal layers: they are drawn side by side, not hidden behind each other. A group
    that is only near-equal gives its range, which the eye cannot read off the plot."""
    for g in groups:
        values = [v for lid in g for v in series[lid] if v is not None]
        lo, hi = min(values, default=0.0), max(values, default=0.0)
        exact = coinciding({lid: series[lid] for lid in g}) == [g]
        what = "equal" if exact else f"{lo:.3f}–{hi:.3f}"
        ax.plot([], [], " ", label=f"layers {', '.join(g)}: {what},\ndrawn side by side")


def reference_margin(margins: dict[str, list[float | None]], n_shards: int) -> str:
    """Per layer: the worst row's error / bound per shard; the check fails above the 1.0 line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 2.4), layout="constrained")
    top = max([1.2] + [v * 1.1 for vals in margins.values() for v in vals if v is not None and v < 1e9])
    groups = _series(ax, margins, "layer", tol=NEAR * top)
    ax.axhline(1.0, color="crimson", lw=1.5, ls="--", label="bound (passes below 1)")
    _equal_note(ax, groups, margins)
    ax.set_ylim(-BELOW_ZERO * top, top)
    ax.set(ylabel="worst error / bound", title="Reference check: worst sampled row per layer, against its bound")
    _shard_axis(ax, n_shards)
    _legend_outside(ax)
    return _png(fig)


def layer_stats(series: dict[str, dict[str, list[float | None]]], n_shards: int) -> str:
    """Four panels, shards on x: mean, std, max |x| and share of outlier tokens per layer."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(WIDTH_IN, 2.6), layout="constrained")
    titles = {
        "mean": "mean",
        "std": "std",
        "max_abs": "max |x|",
        "outlier_share": "outlier tokens",
    }
    for ax, (stat, title) in zip(axes, titles.items(), strict=True):
        if groups := _series(ax, series.get(stat, {}), "layer"):
            title += f"\n(layers {'; '.join(', '.join(g) for g in groups)} equal)"
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=8)
        _shard_axis(ax, n_shards)
        if stat == "outlier_share":  # a share is never negative: the margin below 0 is only the markers'
            ax.set_ylim(bottom=-BELOW_ZERO * ax.get_ylim()[1])
            ax.yaxis.set_major_formatter(lambda y, _: f"{y:.1%}")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, fontsize=8, loc="outside right upper", frameon=False)
    return _png(fig)


def vocab_coverage(cov: dict[str, Any]) -> str:
    """Share of loss-masked tokens covered by the n most frequent ids, marked at the usual draft sizes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 2.8), layout="constrained")
    xs, ys = zip(*cov["curve"], strict=True) if cov["curve"] else ((1,), (0.0,))
    ax.plot(xs, ys, color="tab:blue", label="top-n ids")
    for n, s in cov["at"].items():
        ax.plot([n], [s], "o", ms=6, label=f"{n // 1024}k: {s:.1%}")
    ax.axvline(cov["distinct_ids"], color="grey", ls=":", label=f"{cov['distinct_ids']:,} distinct ids seen")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.yaxis.set_major_formatter(lambda y, _: f"{y:.0%}")
    ax.set(xlabel="draft vocabulary size n (most frequent ids)", ylabel="loss-masked tokens covered")
    ax.set_title("Draft-vocabulary coverage (token_freq.json)")
    _legend_outside(ax)
    return _png(fig)


def distributions(rows, max_seq_len: int | None = None, truncated_rows: int = 0) -> str:
    """Tokens per row and share of loss-masked tokens per row, side by side. Rows cut to max_seq_len pile
    up in the last bin: they are drawn in their own colour and the cap is a marked line."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(WIDTH_IN, 2.6), layout="constrained")
    lengths = rows["seq_len"]
    if max_seq_len and len(lengths) and int(lengths.max()) <= max_seq_len:
        edges = _length_bins(min(int(lengths.min()), max_seq_len - 1), max_seq_len)
        at_cap = lengths >= max_seq_len
        a.hist(
            [lengths[~at_cap], lengths[at_cap]],
            bins=edges,
            stacked=True,
            color=["tab:blue", "crimson"],
            # the bar holds every row at the cap, the cut ones and any exactly that long
            label=["rows", f"at max_seq_len: {_rows(int(at_cap.sum()))} ({truncated_rows:,} cut to it)"],
        )
        a.axvline(max_seq_len, color="crimson", ls="--", lw=1, label=f"max_seq_len {max_seq_len:,}")
        a.legend(fontsize=8, loc="upper left", frameon=False)
    else:
        a.hist(lengths, bins=40)
    a.set(xlabel="tokens per row", ylabel="rows", title="Sequence lengths")
    b.hist(rows["mask_share"], bins=40, range=(0, 1))
    b.set(xlabel="share of the row's tokens with loss_mask = 1", ylabel="rows", title="Loss-mask share per row")
    return _png(fig)


def _rows(n: int) -> str:
    return f"{n:,} row" + "s" * (n != 1)


def _length_bins(low: int, cap: int, n: int = 40) -> list[float]:
    """Up to n equal bins from `low` to the cap, then the cap's own bin: the spike of cut rows is one
    bar, not mixed with the rows just below it."""
    n = max(min(n, cap - low), 1)
    width = (cap - low) / n
    return [low + i * width for i in range(n)] + [float(cap), cap + max(width, 1.0)]


def throughput_and_disk(summary) -> str:
    """Extract tokens/s per shard (capture alone and whole job) and MiB on disk per shard."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(WIDTH_IN, 2.8), layout="constrained")
    x = list(summary["shard"])
    a.bar([i - 0.2 for i in x], summary["tokens_per_s"].fillna(0), width=0.4, label="capture")
    a.bar([i + 0.2 for i in x], summary["job_tokens_per_s"].fillna(0), width=0.4, label="whole job")
    a.set(ylabel="tokens/s", title="Extract throughput")
    a.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.08), ncol=2, frameon=False)
    b.bar(x, summary["bytes"] / 2**20)
    b.set(ylabel="MiB", title="Bytes on disk")
    for ax in (a, b):
        _shard_axis(ax, len(x))
    return _png(fig)
