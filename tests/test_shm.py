"""infra/shm.py: what a SIGKILLed engine leaves in /dev/shm is removed by the next job, and nothing else is.

A child in its own session stands in for vLLM's engine: it creates a `multiprocessing.shared_memory`
segment (as vLLM's message queues do) and takes it off Python's resource tracker, as a SIGKILL to the
whole process group would (the tracker dies with the group and never unlinks it).
"""

import os
import signal
import subprocess
import sys

import pytest

from eagle3prep.infra import shm

HOLDER = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
name = sys.argv[1] if len(sys.argv) > 1 else None
seg = shared_memory.SharedMemory(name=name, create=name is None, size=1 << 20)
resource_tracker.unregister(seg._name, "shared_memory")
print(seg.name, flush=True)
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def records(tmp_path, monkeypatch):
    monkeypatch.setenv(shm.LOCK_DIR_ENV, str(tmp_path / "locks"))
    return tmp_path / "locks" / "shm"


@pytest.fixture
def holders():
    started = []

    def start(name=None):
        args = [sys.executable, "-c", HOLDER] + ([name] if name else [])
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
        started.append(proc)
        return proc, proc.stdout.readline().strip()

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def kill(proc):
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def unlink(name):
    (shm.SHM_DIR / name).unlink(missing_ok=True)


def test_a_killed_engines_segment_is_removed_by_the_next_sweep(holders, records):
    proc, name = holders()
    path = shm.record_engine(proc.pid)
    assert path == records / f"{proc.pid}.json" and name in path.read_text()
    assert shm.sweep() == [] and (shm.SHM_DIR / name).exists()  # its job still runs: untouched
    kill(proc)
    assert (shm.SHM_DIR / name).exists()  # the kill leaves it, as vLLM's does
    lines = []
    assert shm.sweep(lines.append) == [name]
    assert not (shm.SHM_DIR / name).exists() and not path.exists()
    assert lines == [
        f"removed 1 shared-memory segment(s) (1 MiB) that the killed vLLM engine of job pid {proc.pid} "
        f"left in {shm.SHM_DIR}"
    ]


def test_a_segment_another_live_process_maps_is_kept_until_it_ends(holders):
    proc, name = holders()
    shm.record_engine(proc.pid)
    reader, _ = holders(name)  # e.g. an orphaned worker of the killed engine
    kill(proc)
    try:
        assert shm.sweep() == [] and (shm.SHM_DIR / name).exists()
        kill(reader)
        assert shm.sweep() == [name]  # the record was kept for this later sweep
    finally:
        unlink(name)


def test_unrecorded_segments_and_live_jobs_are_never_touched(holders):
    stranger, name = holders()  # not recorded: someone else's
    kill(stranger)
    job, own = holders()
    shm.record_engine(job.pid)
    try:
        assert shm.sweep() == []
        assert (shm.SHM_DIR / name).exists() and (shm.SHM_DIR / own).exists()
    finally:
        unlink(name)
        unlink(own)


def test_a_reused_pid_counts_as_a_dead_job(holders, records):
    proc, name = holders()
    kill(proc)
    # The record names a pid that now belongs to another process (this one): its start time differs.
    records.mkdir(parents=True)
    record = records / f"{os.getpid()}.json"
    record.write_text(f'{{"pid": {os.getpid()}, "started": 1.0, "segments": ["{name}"]}}')
    assert shm.sweep() == [name] and not record.exists()


def test_forget_after_a_clean_shutdown_and_no_record_without_segments(holders, records):
    assert shm.record_engine() is None  # this process maps no psm_ segment
    proc, name = holders()
    path = shm.record_engine(proc.pid)
    shm.forget_engine(proc.pid)
    assert not path.exists()
    kill(proc)
    unlink(name)


def test_a_damaged_record_is_dropped_without_an_error(records):
    records.mkdir(parents=True)
    for i, text in enumerate(["{not json", '{"segments": ["psm_x"]}', '{"pid": "x", "segments": []}', "[1]"]):
        (records / f"{i}.json").write_text(text)
    assert shm.sweep() == [] and not list(records.glob("*.json"))
