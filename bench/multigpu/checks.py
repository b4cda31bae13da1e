"""The pure checks of bench/multi_gpu.py (tests/test_multi_gpu.py): which jobs ran at once, whether they
shared a GPU, the aggregate rates, how many GPUs nvidia-smi saw busy, the kill trigger and the verdict."""

from __future__ import annotations

import re

BUSY_UTIL = 50  # nvidia-smi utilization.gpu (%) at or above which a sample counts a GPU as busy
TARGET_SHARE = 0.95  # issue 17: N jobs at once must reach 0.95 x N x one job's tokens/s (1.9 at 2, 7.6 at 8)


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Two [start, end) intervals share some time."""
    return a[0] < b[1] and b[0] < a[1]


def max_concurrency(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at one instant; an interval ending when another starts does not count."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])  # -1 sorts first
    most = cur = 0
    for _, step in events:
        cur += step
        most = max(most, cur)
    return most


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one interval."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def gpu_conflicts(jobs: list[dict]) -> list[dict]:
    """Pairs of jobs that held a GPU id in common while both held their GPUs (`hold` intervals)."""
    out = []
    for i, a in enumerate(jobs):
        for b in jobs[i + 1 :]:
            shared = sorted(set(a["gpus"]) & set(b["gpus"]))
            if shared and overlap(a["hold"], b["hold"]):
                out.append({"shards": [a["shard"], b["shard"]], "gpus": shared})
    return out


def aggregate_rate(jobs: list[dict], start: str = "started_at", end: str = "capture_ended_at") -> dict:
    """Total tokens / (last `end` - first `start`): the run's throughput, engine starts included."""
    if not jobs:
        return {"tokens": 0, "span_s": 0.0, "tokens_per_s": None}
    span = max(j[end] for j in jobs) - min(j[start] for j in jobs)
    tokens = sum(j["tokens"] for j in jobs)
    return {"tokens": tokens, "span_s": round(span, 3), "tokens_per_s": round(tokens / span, 1) if span > 0 else None}


def capture_rate(jobs: list[dict]) -> dict:
    """Total tokens / time during which at least one capture ran: the aggregate without engine starts
    (one job at a time: the mean job rate; N captures fully at once: N times it)."""
    if not jobs:
        return {"tokens": 0, "span_s": 0.0, "tokens_per_s": None}
    span = union_length([(j["capture_started_at"], j["capture_ended_at"]) for j in jobs])
    tokens = sum(j["tokens"] for j in jobs)
    return {"tokens": tokens, "span_s": round(span, 3), "tokens_per_s": round(tokens / span, 1) if span > 0 else None}


def busy_gpus(samples: list[dict], window: tuple[float, float] | None = None, threshold: int = BUSY_UTIL) -> dict:
    """From nvidia-smi samples ({"t", "gpus": {index: [util %, MiB]}}): the share of samples in which
    each GPU was busy, and the most GPUs busy in one sample, within `window` if given."""
    picked = [s for s in samples if s.get("gpus") and (window is None or window[0] <= s["t"] <= window[1])]
    share: dict[str, float] = {}
    most = 0
    for s in picked:
        busy = [g for g, (util, _mem) in s["gpus"].items() if util >= threshold]
        most = max(most, len(busy))
        for g in s["gpus"]:
            share[g] = share.get(g, 0.0) + (g in busy) / len(picked)
    return {
        "samples": len(picked),
        "busy_share": {g: round(v, 3) for g, v in sorted(share.items(), key=lambda kv: int(kv[0]))},
        "max_busy_at_once": most,
        "threshold_util": threshold,
    }


def visible_gpus(claim: dict | None) -> list[str]:
    """The host GPUs a job ran on, from timings.json's gpu_claim (its CUDA_VISIBLE_DEVICES entries)."""
    if not claim or not claim.get("cuda_visible_devices"):
        return []
    return [v.strip() for v in claim["cuda_visible_devices"].split(",") if v.strip()]


def tqdm_percent(log_text: str) -> int | None:
    """The last percentage the extract job's tqdm bar printed ("shard 3:  42%|..."), None before any."""
    found = re.findall(r"shard \d+:\s+(\d+)%\|", log_text)
    return int(found[-1]) if found else None


def limit_verdict(
    ratio: float | None,
    want: float,
    written_bps: float | None,
    disk_bps: float | None,
    mem_peak: float | None,
    mem_total: float | None,
    gpu_busy: float | None,
    disk_wait_share: float | None = None,
) -> str:
    """Which limit the run hit, from the facts measured in it, in one line. `disk_wait_share`: the
    longest time a job's layer writer waited for the disk, over that job's capture time."""
    if ratio is None:
        return "no ratio: no baseline run of this config in OUT yet"
    if ratio >= want:
        return f"{ratio:.2f} >= {want:.2f}: no limit hit"
    facts = []
    if written_bps and disk_bps and written_bps >= 0.85 * disk_bps:
        facts.append(f"disk: shards written at {written_bps / 1e9:.2f} GB/s, the disk took {disk_bps / 1e9:.2f} GB/s")
    if disk_wait_share and disk_wait_share >= 0.05:
        facts.append(f"disk: a job's layer writers waited for it {disk_wait_share:.0%} of its capture")
    if mem_peak and mem_total and mem_peak >= 0.85 * mem_total:
        facts.append(f"host memory: {mem_peak / 2**30:.0f} of {mem_total / 2**30:.0f} GiB used at the peak")
    if gpu_busy is not None and gpu_busy < 0.8:
        facts.append(f"GPUs busy in only {gpu_busy:.0%} of the capture window's samples (host side, engine start)")
    return f"{ratio:.2f} < {want:.2f}: " + ("; ".join(facts) if facts else "no measured limit explains it")
