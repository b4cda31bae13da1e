"""Errors a user can fix (bad input, bad config, a failed check), reported as one line, not a traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from typing import NoReturn

# The user's own `snakemake` command, which the main process hands its jobs here (run/command.py reads it from the
# command line), so that every command a message suggests is one the user can paste.
COMMAND_ENV = "EAGLE3PREP_COMMAND"


def same_command(*args: str) -> str:
    """The user's command with `args` after it, as the main process handed it down; `snakemake` alone outside a
    run (python -m eagle3prep.verify, tests)."""
    base = shlex.split(os.environ.get(COMMAND_ENV) or "snakemake")
    return shlex.join([*base, *args])


class UserError(Exception):
    """Base of every error whose message alone tells the user what to fix."""


class ConfigError(UserError, ValueError):
    """A config value is wrong; the message names the key, the value and what is allowed."""


class Terminated(BaseException):
    """SIGTERM reached the job (a Slurm preemption, `scancel`, a node drain): unwound like Ctrl-C, so the
    engine is shut down and no half-written output is sealed."""


TERMINATED_LINE = (
    "stopped by SIGTERM (a scheduler's preemption, scancel or a shutdown): this job's outputs are incomplete and were "
    "not sealed; finished shards are kept; the same command redoes this job"
)


INTERRUPTED_LINE = "interrupted (Ctrl-C): this job's outputs are incomplete; the same command redoes it"


def exit_now(line: str, status: int) -> NoReturn:
    """The job's last line, then its end without unwinding (what would unwind is stuck: engine/watch.py)."""
    print(line, file=sys.stderr, flush=True)
    os._exit(status)


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


# A full disk or an exhausted quota outside the shard writers (which say so themselves, infra/disk.py):
# the user's to fix, never a traceback.
_DISK_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


@contextlib.contextmanager
def one_line_errors(oom_fix: str = "") -> Iterator[None]:
    """In a Snakemake script: print a UserError as `error: <message>` and exit 1 (the job fails). Ctrl-C is
    one line too, not a traceback per job: the job fails (130), and the next run redoes it from its start.
    `oom_fix`: the settings that change a torch out-of-memory error in this job, which then is one line too
    (its traceback stays in the log above). These lines are printed, not logged: `error: ...` is the job's
    verdict, read as is by users and tests, not one more `[stage]` line (eagle3prep.infra.log)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # the job's own process; vLLM's keep theirs
    try:
        yield
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except Terminated:
        print(f"error: {TERMINATED_LINE}", file=sys.stderr)
        sys.exit(143)
    except OSError as e:
        if e.errno not in _DISK_FULL:
            raise
        import traceback

        traceback.print_exc()
        where = f" writing {e.filename}" if e.filename else ""
        print(
            f"error: {_DISK_FULL[e.errno]}{where}; finished shards are kept: free space (`df -h results`) or point "
            "results/ at a larger filesystem, then run the same command again (`snakemake plan` gives each shard's size)",
            file=sys.stderr,
        )
        sys.exit(1)
    except Exception as e:
        if not oom_fix or type(e).__name__ != "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch
            raise
        import traceback

        traceback.print_exc()
        first = str(e).strip().split(". ")[:2]  # "CUDA out of memory. Tried to allocate 7.83 GiB"
        print(f"error: {'. '.join(first).rstrip('.')}; {oom_fix}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(INTERRUPTED_LINE, file=sys.stderr)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
