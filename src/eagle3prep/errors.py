"""Errors a user can fix (bad input, bad config, a failed check), reported as one line, not a traceback."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


class UserError(Exception):
    """Base of every error whose message alone tells the user what to fix."""


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """In a Snakemake script: print a UserError as `error: <message>` and exit 1 (the job fails)."""
    try:
        yield
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
