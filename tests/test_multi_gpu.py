"""The pure helpers of bench/multi_gpu.py (in bench/multigpu/checks.py) that decide issue 17's checks: which
jobs ran at once, whether they shared a GPU, the aggregate rate, how many GPUs nvidia-smi saw busy, and the
kill trigger."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mg():
    spec = importlib.util.spec_from_file_location("multigpu_checks", REPO / "bench" / "multigpu" / "checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def job(shard, gpus, start, end, tokens=100):
    return {
        "shard": shard,
        "gpus": gpus,
        "hold": (start, end),
        "started_at": start - 1,
        "capture_started_at": start + 1,
        "capture_ended_at": end,
        "tokens": tokens,
    }


def test_overlap_and_concurrency(mg):
    assert mg.overlap((0, 2), (1, 3)) and not mg.overlap((0, 1), (1, 2))  # touching is not overlapping
    assert mg.max_concurrency([(0, 2), (1, 3), (2, 4)]) == 2
    assert mg.max_concurrency([(0, 1), (1, 2), (2, 3)]) == 1
    assert mg.max_concurrency([(0, 10), (1, 2), (3, 4), (1.5, 3.5)]) == 3
    assert mg.max_concurrency([]) == 0


def test_gpu_conflicts_only_for_jobs_that_overlap(mg):
    jobs = [job(0, ["0"], 0, 10), job(1, ["1"], 0, 10), job(2, ["0"], 10, 20), job(3, ["1", "2"], 5, 15)]
    # 0 and 2 share GPU 0 one after the other: fine; 1 and 3 share GPU 1 at once: a conflict.
    assert mg.gpu_conflicts(jobs) == [{"shards": [1, 3], "gpus": ["1"]}]


def test_aggregate_rate_spans_first_start_to_last_end(mg):
    jobs = [job(0, ["0"], 1, 10, tokens=900), job(1, ["1"], 5, 20, tokens=1000)]
    assert mg.aggregate_rate(jobs) == {"tokens": 1900, "span_s": 20.0, "tokens_per_s": 95.0}  # 0 .. 20
    assert mg.aggregate_rate([])["tokens_per_s"] is None
    # without engine starts: tokens over the time some capture ran, [2, 10] and [6, 20] -> 18 s
    assert mg.capture_rate(jobs) == {"tokens": 1900, "span_s": 18.0, "tokens_per_s": 105.6}
    assert mg.union_length([(0, 1), (2, 3), (2.5, 4), (10, 11)]) == 4.0


def test_busy_gpus_counts_gpus_busy_in_the_same_sample(mg):
    samples = [
        {"t": 0, "gpus": {"0": [90, 1], "1": [0, 1]}},
        {"t": 1, "gpus": {"0": [95, 1], "1": [80, 1]}},
        {"t": 2, "gpus": {"0": [10, 1], "1": [99, 1]}},
        {"t": 9, "gpus": {"0": [99, 1], "1": [99, 1]}},  # outside the window
    ]
    got = mg.busy_gpus(samples, window=(0, 2))
    assert got["max_busy_at_once"] == 2 and got["samples"] == 3
    assert got["busy_share"] == {"0": pytest.approx(2 / 3, abs=1e-3), "1": pytest.approx(2 / 3, abs=1e-3)}


def test_visible_gpus_and_tqdm_percent(mg):
    assert mg.visible_gpus({"cuda_visible_devices": "2,3", "source": "locks"}) == ["2", "3"]
    assert mg.visible_gpus({"cuda_visible_devices": None, "source": "none"}) == []
    log = "shard 1:   0%|          | 0/40k\rshard 1:  42%|####      | 17k/40k [00:02<00:03]\n"
    assert mg.tqdm_percent(log) == 42 and mg.tqdm_percent("[extract] shard 1: 90 rows") is None


def test_limit_verdict_names_the_limit(mg):
    assert "no limit hit" in mg.limit_verdict(1.95, 1.9, 1e9, 2e9, 1, 10, 1.0)
    assert "disk" in mg.limit_verdict(1.2, 7.6, 1.4e9, 1.5e9, 1, 10, 1.0)
    assert "host memory" in mg.limit_verdict(1.2, 7.6, 1e8, 1.5e9, 9.5, 10, 1.0)
    assert "no measured limit" in mg.limit_verdict(1.2, 1.9, 1e8, 1.5e9, 1, 10, None)
    assert "waited for it 20%" in mg.limit_verdict(1.2, 1.9, 1e8, 1.5e9, 1, 10, None, disk_wait_share=0.2)
