"""The engine watch (vllm/engine/watch.py): a driver blocked on a dead engine core is woken with one line.

The engine core here is a plain child process named as vLLM names it; the driver's blocked wait is a queue.get()
without a timeout, which is where vLLM's client waits for the next step's outputs. tests/test_vllm_workflow.py
kills vLLM's own engine core mid-shard (engine_core_killed)."""

import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eagle3prep.vllm.engine import watch
from eagle3prep.vllm.engine.watch import EngineGone, engine_processes, engine_watch, how_it_ended

SRC = Path(__file__).resolve().parents[1] / "src"


def child(name: str) -> multiprocessing.Process:
    proc = multiprocessing.Process(target=time.sleep, args=(60,), name=name, daemon=True)
    proc.start()
    return proc


def kill_later(proc: multiprocessing.Process, after: float = 0.3) -> None:
    threading.Timer(after, os.kill, (proc.pid, signal.SIGKILL)).start()


def test_a_killed_engine_core_wakes_the_blocked_driver_with_how_it_ended(monkeypatch):
    monkeypatch.setattr(watch, "POLL_S", 0.05)
    core = child("EngineCore")
    kill_later(core)
    with (
        pytest.raises(EngineGone, match=rf"engine core process \(pid {core.pid}\) was killed by SIGKILL: out of host"),
        engine_watch(lambda how: how),
    ):
        queue.Queue().get()  # blocks for good, as vLLM's client does on a dead engine core


def test_the_watch_finds_the_engine_core_by_vllms_process_names():
    cores, other = [child("EngineCore"), child("EngineCore_DP0")], child("SomethingElse")
    try:
        found = {p.pid for p in engine_processes()}
        assert {p.pid for p in cores} <= found and other.pid not in found
    finally:
        for p in [*cores, other]:
            p.kill()
            p.join()


def test_a_clean_block_leaves_no_watch_behind(monkeypatch):
    monkeypatch.setattr(watch, "POLL_S", 0.05)
    core = child("EngineCore")
    before = signal.getsignal(watch.SIGNAL)
    with engine_watch(lambda how: how, [core]):
        time.sleep(0.2)
    core.kill()  # the engine stopped after the block (its shutdown): nothing fires
    core.join()
    time.sleep(0.2)
    assert signal.getsignal(watch.SIGNAL) is before
    assert not [t for t in threading.enumerate() if t.name == "e3p-engine-watch"]


def test_outside_the_main_thread_the_block_runs_unwatched():
    seen = []

    def run():
        with engine_watch(lambda how: how, [child("EngineCore")]):
            seen.append(threading.current_thread().name)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [t.name]


def test_a_process_that_exits_on_its_own_is_named_with_its_code():
    proc = multiprocessing.Process(target=sys.exit, args=(3,), name="EngineCore")
    proc.start()
    proc.join()
    assert how_it_ended(proc) == f"vLLM's engine core process (pid {proc.pid}) exited with code 3 without a traceback"


FALLBACK = """
import multiprocessing, os, signal, threading, time
from eagle3prep.errors import Terminated
from eagle3prep.vllm.engine import watch
watch.POLL_S, watch.GRACE_S = 0.05, 0.5
core = multiprocessing.Process(target=time.sleep, args=(60,), name="EngineCore", daemon=True)
core.start()
w = watch.EngineWatch(lambda how: f"vLLM died generating replies: {how}").start()
threading.Timer(0.3, os.kill, (core.pid, signal.SIGKILL)).start()
try:
    if STOPPING:
        raise Terminated
    threading.Event().wait(30)  # a wait on the dead engine outside the watched steps (the stage's own cleanup)
except Terminated:
    threading.Event().wait(30)  # SIGTERM's unwinding, blocked on the dead engine as well
print("not reached")
"""


@pytest.mark.parametrize("stopping", [False, True])
def test_unwinding_that_blocks_ends_the_job_on_its_own_with_its_one_line(stopping):
    """A wait on the dead engine the signal cannot end: after GRACE_S the job prints its line and exits, the line of
    what it was stopping for when there was one (SIGTERM: 143)."""
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", f"STOPPING = {stopping}\n{FALLBACK}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "not reached" not in done.stdout, done.stderr
    if stopping:
        assert done.returncode == 143 and lines[0].startswith("error: stopped by SIGTERM"), done.stderr
    else:
        assert done.returncode == 1, done.stderr
        assert lines[0].startswith("error: vLLM died generating replies: vLLM's engine core process"), done.stderr
        assert "killed by SIGKILL" in lines[0]
    assert time.monotonic() - t0 < 30  # it did not sit out the wait


@pytest.mark.parametrize("wait", [lambda: time.sleep(0.5), lambda: queue.Queue().get()], ids=["busy", "blocked"])
def test_a_stop_under_way_stays_the_verdict_and_a_wait_inside_it_ends_with_it(monkeypatch, wait):
    """SIGTERM (Terminated) or Ctrl-C ends the engine core too: the engine's end does not mask the stop, and the
    cleanup's wait on the dead engine (dropping the shard's requests) ends with the stop raised again there."""
    monkeypatch.setattr(watch, "POLL_S", 0.05)

    class Stopped(BaseException):
        pass

    core = child("EngineCore")
    with pytest.raises(Stopped), engine_watch(lambda how: how, [core]):
        try:
            raise Stopped
        except Stopped:
            core.kill()
            wait()  # a blocked one lasts for good unless the stop is raised again here
            raise


class _StuckEngine:
    """vLLM's LLMEngine as a driver sees it after its engine core was SIGKILLed: step() never returns."""

    def step(self):
        queue.Queue().get()


def test_the_regenerate_stage_stops_in_one_line_when_its_engine_core_is_killed_mid_step(monkeypatch):
    from types import SimpleNamespace

    from eagle3prep.regenerate.engine import VLLMEngine
    from eagle3prep.vllm.engine.errors import EngineError

    monkeypatch.setattr(watch, "POLL_S", 0.05)
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine.info, engine.volatile = SimpleNamespace(llm_engine=_StuckEngine()), {}, {}
    engine.info["engine_version"] = "0.34.0"
    core = child("EngineCore")
    engine._watch = watch.EngineWatch(lambda how: VLLMEngine._died("0.34.0", how), [core]).start()
    kill_later(core)
    try:
        with pytest.raises(EngineError, match=r"^vLLM 0\.34\.0 died generating replies: vLLM's engine core process"):
            engine.step()
    finally:
        engine._watch.stop()
    # a step after it raises at once (the watch remembers), and the line names the stage's own settings
    with pytest.raises(EngineError, match=r"lower regenerate\.max_num_batched_tokens"):
        engine.step()
