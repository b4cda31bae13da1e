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


@pytest.fixture()
def moe(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import multigpu.moe

    return multigpu.moe


DEEPSEEK_V3 = {  # DeepSeek-V3's config.json, the keys the count reads (huggingface.co/deepseek-ai/DeepSeek-V3)
    "hidden_size": 7168, "num_attention_heads": 128, "num_hidden_layers": 61, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "first_k_dense_replace": 3, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 256,
}  # fmt: skip


def test_moe_flops_count_deepseek_v3s_active_parameters(moe):
    # DeepSeek-V3 activates 37B parameters a token; the count leaves out embeddings and lm_head (0.9B each)
    active = moe.moe_flops_per_token(DEEPSEEK_V3, 0) / 2
    assert 34.5e9 < active < 36e9
    per_token_attention = moe.moe_flops_per_token(DEEPSEEK_V3, 1000) - moe.moe_flops_per_token(DEEPSEEK_V3, 0)
    assert per_token_attention == 61 * 1000 * 128 * (192 + 128)


def test_moe_phase_namespace_feeds_bench_extracts_workloads(moe, tmp_path):
    """The phase's arguments are bench_extract's: a key bench_extract reads and moe-prefill lacks crashed the
    2026-12-02 H200 run (args.images)."""
    from extractbench import workload

    args = moe.argparse.Namespace(
        out=tmp_path, phase="b", device="cpu", rows=4, seq=32, min_len=8, max_len=40, capture_path="hooks",
        batched_tokens=512, batch_tokens=2048, gpu_mem=0.5, tp=1,
    )  # fmt: skip
    ns = moe.phase_namespace(args, {"hidden_size": 256})
    work = workload.workloads(ns)
    assert [len(r) for r in work["uniform"]] == [32] * 4 and sum(map(len, work["mixed"])) >= 4 * 32
    assert ns.image_threads == 0  # phase_b reads it: the image pool as the code has it


def test_moe_table_from_the_h200_run(moe):
    import json

    data = json.loads((REPO / "docs/runs/h200_2026-12-02_pending/mgm25/moe_prefill.json").read_text())
    table = "\n".join(moe.moe_table(data, 2048, 2148))
    assert "| uniform | 102,488 | 65 % | 40,770 | 0.40 | hooks |" in table
    assert "| 24,266 | 0.24 | 1,043,923,655 |" in table
