"""tokenize.max_seq_len against the model's context, per backend: vLLM samples one token after each row, so a row
that fills the context is refused at parse time, not by the engine after the GPU jobs before it."""

import json

import pytest

from eagle3prep.config.model import check_max_seq_len
from eagle3prep.errors import ConfigError


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024, "num_hidden_layers": 8}))
    return tmp_path


def test_rows_that_fit_pass(model):
    check_max_seq_len(1024, model)  # transformers needs no room after the row
    check_max_seq_len(1023, model, "vllm")


def test_a_row_filling_the_context_is_refused_for_vllm(model):
    with pytest.raises(ConfigError) as e:
        check_max_seq_len(1024, model, "vllm")
    assert str(e.value) == (
        f"config error: tokenize.max_seq_len = 1024 fills the model's context of 1024 tokens (max_position_embeddings "
        f"in {model}/config.json), and extract.backend vllm samples one token after each row; set it to 1023 or less"
    )


@pytest.mark.parametrize("backend, fits", [("hf", 1024), ("vllm", 1023)])
def test_a_row_past_the_context_names_the_longest_that_fits(model, backend, fits):
    with pytest.raises(ConfigError, match=f"is above the model's context of 1024 tokens .*; set it to {fits} or less"):
        check_max_seq_len(4096, model, backend)


def test_the_engine_is_asked_for_one_position_more():
    # The room check above mirrors this: a row of max_seq_len tokens and the token sampled after it.
    from types import SimpleNamespace

    from eagle3prep.vllm.capture.engine_args import engine_kwargs

    content = SimpleNamespace(enforce_eager=True, quantization=None, engine_args={})
    speed = SimpleNamespace(max_num_batched_tokens=8192, gpu_memory_utilization=0.5)
    spec = SimpleNamespace(
        settings=SimpleNamespace(content=content, speed=speed), model_path="m", dtype="bfloat16", tp_size=1,
        max_seq_len=1023, trust_remote_code=False,
    )  # fmt: skip
    facts = SimpleNamespace(vision_model_type=None)
    assert engine_kwargs(spec, facts, {}, {})["max_model_len"] == 1024
