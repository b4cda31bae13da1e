"""Errors a user can fix (bad input, bad config, a failed check), reported as one line, not a traceback."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


class UserError(Exception):
    """Base of every error whose message alone tells the user what to fix."""


class ConfigError(UserError, ValueError):
    """A config value is wrong; the message names the key, the value and what is allowed."""


@contextlib.contextmanager
def one_line_errors(oom_fix: str = "") -> Iterator[None]:
    """In a Snakemake script: print a UserError as `error: <message>` and exit 1 (the job fails). Ctrl-C is
    one line too, not a traceback per job: the job fails (130), and the next run redoes it from its start.
    `oom_fix`: the settings that change a torch out-of-memory error in this job, which then is one line too
    (its traceback stays in the log above). These lines are printed, not logged: `error: ...` is the job's
    verdict, read as is by users and tests, not one more `[stage]` line (eagle3prep.infra.log)."""
    try:
        yield
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
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
        print("interrupted (Ctrl-C): this job's outputs are incomplete; the same command redoes it", file=sys.stderr)
        sys.exit(130)
