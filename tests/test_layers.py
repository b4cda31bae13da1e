"""Layer numbering (DESIGN.md §2) against transformers itself, on the demo model."""

import pytest
import torch

from eagle3prep.backends.hf import HFBackend
from eagle3prep.layers import (
    check_layer_ids,
    convert_layer_ids,
    default_layer_ids,
    resolve_layer_ids,
    to_convention,
)

from testkit.shards import capture_rows, capture_spec


def test_default_ids_are_three_aux_layers_plus_final():
    assert default_layer_ids(32) == [2, 16, 29, 32]  # Llama-3.1-8B
    assert default_layer_ids(61) == [2, 30, 58, 61]  # Kimi-K2.5
    assert default_layer_ids(8) == [2, 4, 5, 8]  # the demo model


def test_output_of_layer_convention_shifts_by_one():
    # Older speculators captured the *output* of layer k: Kimi-K2.5's "2 30 58 60".
    assert convert_layer_ids([2, 30, 58, 60], "output_of_layer") == [3, 31, 59, 61]
    assert to_convention([3, 31, 59, 61], "output_of_layer") == [2, 30, 58, 60]
    assert resolve_layer_ids([2, 30, 58, 60], "output_of_layer", 61) == [3, 31, 59, 61]


@pytest.mark.parametrize(
    ("ids", "match"),
    [([], "empty"), ([1, 1], "duplicate"), ([1, 9], r"outside 0\.\.8"), ([-1, 2], "outside"), ([4, 2], "ascending")],
)
def test_bad_ids_name_the_problem(ids, match):
    with pytest.raises(ValueError, match=match):
        check_layer_ids(ids, 8)


def test_unknown_convention():
    with pytest.raises(ValueError, match="not one of"):
        convert_layer_ids([1], "sglang_plus_two")


@pytest.fixture(scope="module")
def fp32_model(demo_model_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    return model


def test_ids_below_n_equal_output_hidden_states(demo_model_dir, fp32_model):
    n = fp32_model.config.num_hidden_layers
    ids = list(range(n + 1))
    backend = HFBackend(
        capture_spec("hf", str(demo_model_dir), ids, dtype="float32", device="cpu", tp_size=1, max_seq_len=2048)
    )
    backend.probe()
    row = list(range(5, 45))
    got = capture_rows(backend, [row])
    with torch.inference_mode():
        ref = fp32_model(torch.tensor([row]), output_hidden_states=True).hidden_states
    for k in range(n):
        torch.testing.assert_close(got[k], ref[k][0], rtol=0, atol=1e-5, msg=f"layer id {k}")
    # Id N is the pre-norm final state: transformers' last entry is that state after the final norm.
    normed = fp32_model.model.norm(got[n])
    torch.testing.assert_close(normed, ref[n][0], rtol=0, atol=1e-5)
    assert (got[n] - ref[n][0]).abs().max() > 0.1, "id N must not be the post-norm state"
    # Every layer moves the residual stream, so an off-by-one can never pass for the right layer.
    for k in range(n):
        assert (got[k + 1] - got[k]).norm() / got[k].norm() > 0.05


def test_batched_padded_capture_equals_single_rows(demo_model_dir):
    ids = [2, 4, 5, 8]
    backend = HFBackend(
        capture_spec("hf", str(demo_model_dir), ids, dtype="float32", device="cpu", tp_size=1, max_seq_len=2048)
    )
    info = backend.probe()
    assert info.final_layer_reachable and info.num_hidden_layers == 8
    rows = [list(range(3, 30)), list(range(40, 47)), list(range(10, 60))]
    batched = capture_rows(backend, rows)
    singles = [capture_rows(backend, [r]) for r in rows]
    for lid in ids:
        assert batched[lid].shape == (sum(map(len, rows)), info.hidden_size)
        # Padded batches change fp32 summation order only: ~1e-5 on values of magnitude ~10.
        torch.testing.assert_close(batched[lid], torch.cat([s[lid] for s in singles]), rtol=1e-4, atol=1e-5)
