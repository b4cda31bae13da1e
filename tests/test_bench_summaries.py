"""The pure readers behind two of docs/evidence.md's measurements: bench_extract's ratios over --rounds (each
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
    # gzipped, as a run folder may hold them, with a byte py-spy's --nonblocking read mid-change
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


@pytest.fixture(scope="module")
def gpu_util():
    sys.path.insert(0, str(REPO / "bench"))  # it reads the log with summarize_extract_runs.rounds_of
    try:
        return _load("gpu_util_summary", REPO / "bench" / "gpu_util_summary.py")
    finally:
        sys.path.remove(str(REPO / "bench"))


def _dmon(bursts: list[tuple[int, int]]) -> str:
    """nvidia-smi dmon lines from 10:00:00: each (busy s, idle s after) at 50 % sm."""
    lines, t = ["#Time gpu sm mem", "#HH:MM:SS Idx % %"], 0
    for busy, idle in bursts:
        for u in [50] * busy + [0] * idle:
            lines.append(f" 10:{t // 60:02d}:{t % 60:02d} 0 {u} 0")
            t += 1
    return "\n".join(lines) + "\n"


def test_gpu_util_matches_every_round_and_a_step_cut_short(gpu_util, tmp_path, capsys, monkeypatch):
    """Each phase of every round gets its own burst; a step the machine's loss cut short is matched on the phases
    its log finished, the burst still running left out."""
    phase = '{"uniform": {"tokens": 1000, "tokens_per_s": 100.0}}'
    (tmp_path / "be").mkdir()
    (tmp_path / "be" / "log").write_text(f"phase a: {phase}\nphase b: {phase}\nround 2 phase a: {phase}\n")
    (tmp_path / "done").write_text("10:00:00 start be: python3 bench/bench_extract.py\n")
    (tmp_path / "gpu_util.txt").write_text(_dmon([(40, 20), (30, 20), (20, 20), (25, 0)]))
    monkeypatch.setattr(sys, "argv", ["gpu_util_summary.py", str(tmp_path)])
    gpu_util.main()
    out = capsys.readouterr().out
    assert "be: cut short; the 3 phases it finished" in out
    assert "be (a): 1,000 tokens timed 10.0 s" in out and "GPU busy 20.0 s = 2.00 of the timed s" in out
    assert "be (b): " in out and "GPU busy 15.0 s" in out
    assert "be (a round 2): " in out and "GPU busy 10.0 s" in out
    # Finished: every burst must be a phase; one burst too many is said, not matched by position.
    (tmp_path / "done").write_text("10:00:00 start be: x\n10:03:00 end be rc 0\n")
    gpu_util.main()
    assert "be: 4 bursts for phases ['a', 'b', 'a round 2']: not matched" in capsys.readouterr().out
