"""A watch on vLLM's engine core process while the driver waits on it.

When the engine core process dies without a word (SIGKILL: the host's OOM killer, a crash in a CUDA library),
vLLM's client sees the process end and closes its sockets, but a driver blocked in `LLMEngine.step` or
`LLM.collective_rpc` waits for a reply that never comes: on vLLM 0.34 at TP 1 a capture job hung for as long as it
was let (docs/runs/crash_safety). The watch polls the engine core processes (children of this process) and, when
one ends, raises EngineGone in the main thread through a signal, which also wakes a blocked wait there. Should the
unwinding itself block on the dead engine, the job ends on its own after GRACE_S with the same one line.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

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


@contextlib.contextmanager
def engine_watch(line: Callable[[str], str], processes: list[multiprocessing.Process] | None = None) -> Iterator[None]:
    """Raise EngineGone in the main thread if one of `processes` (default: engine_processes()) ends inside the
    block. Outside the main thread, or with no engine core process to watch, the block runs unwatched.
    `line(how)`: the job's one line for it, printed before the job ends on its own if unwinding outlasts GRACE_S."""
    procs = engine_processes() if processes is None else processes
    if not procs or threading.current_thread() is not threading.main_thread():
        yield
        return
    gone: list[str] = []
    stop = threading.Event()
    main = threading.main_thread().ident

    def raise_gone(signum: int, frame: object) -> None:
        if gone and not stop.is_set():
            raise EngineGone(gone[0])

    def watch() -> None:
        while not stop.wait(POLL_S):
            ended = next((p for p in procs if not p.is_alive()), None)
            if ended is None:
                continue
            gone.append(how_it_ended(ended))
            signal.pthread_kill(main, SIGNAL)
            if not stop.wait(GRACE_S):  # the unwinding blocked on the dead engine too
                print(f"error: {line(gone[0])}", file=sys.stderr, flush=True)
                os._exit(1)
            return

    previous = signal.signal(SIGNAL, raise_gone)
    thread = threading.Thread(target=watch, name="e3p-engine-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        signal.signal(SIGNAL, previous)
