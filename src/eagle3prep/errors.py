"""Errors a user can fix (bad input, bad config, a failed check), reported as one line, not a traceback."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


class UserError(Exception):
    """Base of every error whose message alone tells the user what to fix."""


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """In a Snakemake script: print a UserError as `error: <message>` and exit 1 (the job fails). Ctrl-C is
    one line too, not a traceback per job: the job fails (130), and the next run redoes it from its start."""
    try:
        yield
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): this job's outputs are incomplete; the same command redoes it", file=sys.stderr)
        sys.exit(130)
