import json
import socket
import subprocess
import sys

from eagle3prep.infra.runlock import LOCKS, RECORD, clear_stale_locks, record_owner


def locked(tmp_path, owner: dict | None):
    (tmp_path / LOCKS).mkdir(parents=True)
    (tmp_path / LOCKS / "0.input.lock").write_text("x")
    if owner is not None:
        (tmp_path / RECORD).write_text(json.dumps(owner))
    return tmp_path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_locks_of_a_dead_run_on_this_host_are_removed(tmp_path):
    wd = locked(tmp_path, {"host": socket.gethostname(), "pid": dead_pid(), "started": 0.0})
    assert clear_stale_locks(wd) == [str(wd / LOCKS / "0.input.lock")]
    assert not list((wd / LOCKS).iterdir()) and not (wd / RECORD).exists()


def test_live_run_other_host_or_unknown_owner_keep_their_locks(tmp_path):
    record_owner(tmp_path / "live")  # this very process: alive
    live = locked(tmp_path / "live", None)
    other = locked(tmp_path / "other", {"host": "elsewhere", "pid": dead_pid(), "started": 0.0})
    unknown = locked(tmp_path / "unknown", None)
    for wd in (live, other, unknown):
        assert clear_stale_locks(wd) == []
        assert (wd / LOCKS / "0.input.lock").exists()


def test_a_reused_pid_is_not_mistaken_for_the_owner(tmp_path):
    import psutil

    me = psutil.Process()
    wd = locked(tmp_path, {"host": socket.gethostname(), "pid": me.pid, "started": me.create_time() - 3600})
    assert clear_stale_locks(wd) == [str(wd / LOCKS / "0.input.lock")]
