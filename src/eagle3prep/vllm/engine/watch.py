"""A watch on vLLM's engine core process while the driver waits on it.

When the engine core process dies without a word (SIGKILL: the host's OOM killer, a crash in a CUDA library),
vLLM's client sees the process end and closes its sockets, but a driver blocked in `LLMEngine.step` or
`LLM.collective_rpc` waits for a reply that never comes: on vLLM 0.34 at TP 1 a capture job hung for as long as it
was let (docs/runs/crash_safety). The watch polls the engine core processes (children of this process) and, when
one ends, raises EngineGone in the main thread through a signal, which also wakes a blocked wait there (a stop
already unwinding, such as SIGTERM's, is raised again instead: it stays the verdict). A wait no signal ends is cut
after GRACE_S: the job prints the line of what stopped it and exits.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import INTERRUPTED_LINE, TERMINATED_LINE, Terminated, exit_now
from .. import registry

SIGNAL = signal.SIGUSR1  # vLLM's driver side installs no handler for it
POLL_S = 1.0
GRACE_S = 120.0  # to unwind (drop the shard's requests, stop the engine) once the engine core is gone


class EngineGone(BaseException):
    """The engine core process ended while the driver was using it; the message says how. A BaseException, as
    Terminated is: no `except Exception` on the way up (best-effort cleanups) may swallow it."""


def engine_processes() -> list[multiprocessing.Process]:
    """This process's live vLLM engine core processes (none with an in-process engine core)."""
    name = registry.entry("EngineCore").path
    return [p for p in multiprocessing.active_children() if p.name == name or p.name.startswith(f"{name}_")]


def how_it_ended(proc: multiprocessing.Process) -> str:
    """One phrase: the engine core process, its pid, and its exit code or signal."""
    code = proc.exitcode
    what = f"vLLM's engine core process (pid {proc.pid})"
    if code is None or code >= 0:
        return f"{what} exited with code {code} without a traceback"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    why = ": out of host memory, most often (the host's OOM killer)" if -code == signal.SIGKILL else ""
    return f"{what} was killed by {name}{why}"


class EngineWatch:
    """The watch of one engine's core processes, from start() to stop(). While armed (the driver is inside a call
    that waits on the engine), an ended process raises EngineGone at once; outside, the next armed() raises it.

    Args:
        line: `line(how)` is the job's one line for it (`how`: how_it_ended), printed before the job ends on its own
            if unwinding outlasts GRACE_S.
        processes: the processes to watch (default: engine_processes()).
    """

    def __init__(self, line: Callable[[str], str], processes: list[multiprocessing.Process] | None = None):
        self.line = line
        self.procs = engine_processes() if processes is None else processes
        self.gone: str | None = None
        self.unwinding: BaseException | None = None  # what the main thread was stopping for when the engine ended
        self._armed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: Any = None

    def start(self) -> EngineWatch:
        """Watch from now on; outside the main thread, or with no engine core process, nothing is watched."""
        if self.procs and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(SIGNAL, self._on_signal)
            self._thread = threading.Thread(target=self._watch, name="e3p-engine-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (before the engine is shut down on purpose)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        signal.signal(SIGNAL, self._previous)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """A block that waits on the engine: EngineGone raised in it as soon as the engine core is gone."""
        if self.gone is not None:
            raise EngineGone(self.gone)
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def _on_signal(self, signum: int, frame: object) -> None:
        # A stop already unwinding (SIGTERM's Terminated, Ctrl-C, the engine's own end) is the job's verdict; a wait on
        # the dead engine inside that unwinding (dropping the shard's requests) ends with it raised again.
        current = sys.exc_info()[1]
        self.unwinding = current or self.unwinding
        if not self._armed or self.gone is None or self._stop.is_set():
            return
        raise current if current is not None else EngineGone(self.gone)

    def _watch(self) -> None:
        main = threading.main_thread().ident
        while not self._stop.wait(POLL_S):
            ended = next((p for p in self.procs if not p.is_alive()), None)
            if ended is not None:
                break
        else:
            return
        self.gone = how_it_ended(ended)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:  # again each POLL_S: each wait of the unwinding on the dead engine ends
            signal.pthread_kill(main, SIGNAL)
            if self._stop.wait(POLL_S):
                return
        self._exit()

    def _exit(self) -> None:
        """The unwinding blocked past GRACE_S: the job's one line for what stopped it, and its exit status."""
        if isinstance(self.unwinding, Terminated):
            exit_now(f"error: {TERMINATED_LINE}", 143)
        if isinstance(self.unwinding, KeyboardInterrupt):
            exit_now(INTERRUPTED_LINE, 130)
        exit_now(f"error: {self.line(self.gone or 'it ended')}", 1)


@contextlib.contextmanager
def engine_watch(line: Callable[[str], str], processes: list[multiprocessing.Process] | None = None) -> Iterator[None]:
    """An EngineWatch started and armed for the block (the capture of one shard)."""
    watch = EngineWatch(line, processes).start()
    try:
        with watch.armed():
            yield
    finally:
        watch.stop()
