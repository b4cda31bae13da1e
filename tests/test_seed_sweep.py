"""The seed sweep (bench/seed_sweep.py) in small: on seeds other than the matrix's 0, correct fp32 MoE captures
pass on every row, the planted mistakes fail, and the capture's router input moves a margin well inside the
near-tie band (passrule.TIE_FACTOR). The full sweep (6 variants x 5 seeds x fp32/bf16 x hf/vllm-cpu) is in
docs/runs/seed_sweep/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from eagle3prep.validate.passrule import TIE_FACTOR
from eagle3prep.validate.reference import ReferencePair

REPO = Path(__file__).resolve().parents[1]
ROWS = 4  # per shard; rows 1 and 3 share a length (rows_swapped)


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("variant", "seed"), [("deepseek_v3_g2", 1), ("qwen2_moe", 2)])
def test_hf_fp32_moe_on_another_seed(tmp_path, variant, seed):
    sweep, matrix = load("seed_sweep"), load("validation_matrix")
    args = argparse.Namespace(out=tmp_path, device="cpu", tp=1, dump=False, storage="model_dtype")
    model = sweep.build_variant(variant, tmp_path / "model", seed)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tokens = [matrix.write_rows(tmp_path / f"t{k}.jsonl", ROWS, vocab, 1000 * seed + k, k * ROWS) for k in range(2)]
    refs = ReferencePair(str(model), "float32", "cpu", cache_rows=2 * ROWS)
    cell = sweep.sweep_cell(matrix, args, variant, seed, model, "float32", "hf", tokens, refs)
    assert cell["correct_ok"], [v["message"] for v in cell["correct"]]
    assert all(v["rows"] == ROWS for v in cell["correct"])
    missed = [m for m, p in cell["planted"].items() if not p["caught"]]
    assert not missed, missed
    assert 0 < cell["margin_moved"]["max"] < TIE_FACTOR / 4, cell["margin_moved"]
