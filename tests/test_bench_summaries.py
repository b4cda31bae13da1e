"""The pure readers behind two of docs/performance.md's measurements: bench_extract's ratios over --rounds (each
capture phase against its own round's (a)) and bench/pyspy_summary.py's account of where a process's main thread
was, from py-spy's raw samples."""

from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(REPO / "bench"))  # report.py imports its siblings as extractbench.*
    try:
        return _load("extractbench_report", REPO / "bench" / "extractbench" / "report.py")
    finally:
        sys.path.remove(str(REPO / "bench"))


@pytest.fixture(scope="module")
def pyspy():
    return _load("pyspy_summary", REPO / "bench" / "pyspy_summary.py")


def rate(v: float) -> dict:
    return {"tokens_per_s": v}


def test_each_round_is_set_against_its_own_a(report):
    rounds = [
        {
            "a": {"uniform": rate(100), "mixed": rate(50)},
            "b": {"uniform": rate(90), "mixed": rate(40), "uniform_shm": rate(95)},
        },
        {
            "a": {"uniform": rate(80), "mixed": rate(50)},
            "b": {"uniform": rate(80), "mixed": rate(45), "uniform_shm": rate(76)},
        },
        {"a": {"uniform": rate(100), "mixed": rate(100)}, "b": {"uniform": rate(97), "mixed": rate(99)}},
    ]
    lines = report.round_ratios(rounds)
    assert lines[0] == "b/a uniform: rounds 0.90 1.00 0.97; median 0.97, 0.90-1.00"
    assert lines[1] == "b/a mixed: rounds 0.80 0.90 0.99; median 0.90, 0.80-0.99"
    # to /dev/shm: against (a)'s uniform rate of the same round, in the rounds that wrote one
    assert lines[2] == "b/a uniform_shm: rounds 0.95 0.95; median 0.95, 0.95-0.95"
    assert len(lines) == 3  # no (f), no uniform_again: nothing made up


def test_a_round_without_a_is_left_out_and_again_uses_a_own_again(report):
    rounds = [
        {"b": {"uniform": rate(90)}},  # (a) failed this round: no ratio from another round's (a)
        {
            "a": {"uniform": rate(100), "uniform_again": rate(50)},
            "b": {"uniform": rate(90), "uniform_again": rate(45)},
        },
    ]
    assert report.round_ratios(rounds) == [
        "b/a uniform: rounds 0.90; median 0.90, 0.90-0.90",
        "b/a uniform_again: rounds 0.90; median 0.90, 0.90-0.90",
    ]


def test_pyspy_summary_counts_main_thread_leaves_by_phase(pyspy, tmp_path, capsys):
    fork = "thread (1): MainThread;probe (eagle3prep/backends/vllm/driver.py:61);run_engine_core (vllm/v1/engine/core.py:1)"
    core = (
        f"{fork};_reduce_data (vllm/multimodal/inputs.py:571) 6\n"  # our driver's frames below vLLM's: not ours
        f"{fork};synchronize (torch/cuda/streams.py:254) 2\n"
        f"{fork};_e3p_keep (eagle3prep/backends/vllm/worker.py:120);wait (threading.py:355) 2\n"  # the hooks'
        "thread (7): Thread-1 (process_input_sockets);poll (zmq/sugar/poll.py:106) 40\n"  # not the main thread
        "thread (1): MainThread 3\n"  # a stack with no frame: skipped
    )
    (tmp_path / "120000_b_core_11.txt").write_text(core)
    # gzipped as docs/runs keeps them, with a byte py-spy's --nonblocking read mid-change
    raw = (
        b"thread (2): MainThread;step (llm_engine.py:304);get_output (core_client.py:853) 5\n\xf9 1\n"
        b"thread (2): MainThread;step (llm_engine.py:304);get_out\xf9 x\n"  # a count read mid-change: skipped
    )
    (tmp_path / "120040_b_driver_12.txt.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "errors.txt").write_text("ignored")
    (tmp_path / "120080_a_core_13.txt").write_text("")  # a window that caught an exiting process: no samples
    pyspy.summarize(tmp_path, top=2)
    out = capsys.readouterr().out.splitlines()
    assert out.pop(0) == "(a) core: 0 main-thread samples in 1 files"  # and no shares divided by zero
    assert out[0] == "(b) core: 10 main-thread samples in 1 files"
    assert out[1].split()[:3] == ["20.0%", "in", "eagle3prep's"]  # the hooks' 2 samples, not the fork's 10
    assert out[2].split() == [
        "60.0%",
        "_reduce_data",
        "inputs.py:571",
        "<",
        "run_engine_core",
        "core.py:1",
        "<",
        "probe",
        "driver.py:61",
    ]
    assert out[3].split()[:2] == ["20.0%", "synchronize"]
    assert len(out) == 6 and out[4] == "(b) driver: 5 main-thread samples in 1 files"
    assert out[5].split()[:2] == ["100.0%", "get_output"]
