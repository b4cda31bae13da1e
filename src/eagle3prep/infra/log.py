"""One voice for what the package and its scripts write to a job's log: the standard library's logging, one format.

`log = get_logger("validate")` names the speaker, and each line reads `[validate] message`, from every stage
alike. Lines go to sys.stderr as it is when they are written: a Snakemake script points stderr at its log file
before anything else (scripts/*.py), pytest swaps it per test, and tqdm's bars, which run/progress.py reads,
share that stream. A failed job's last line stays errors.py's `error: ...`, which users and tests read as is.
"""

from __future__ import annotations

import logging
import sys

ROOT = "eagle3prep"
FORMAT = "[%(speaker)s] %(message)s"


class _CurrentStderr(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is at each line, not on the stream it was made with."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass  # always the current sys.stderr


class _SpeakerFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.speaker = record.name.removeprefix(ROOT + ".")
        return super().format(record)


def _root() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _CurrentStderr) for h in root.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(_SpeakerFormatter(FORMAT))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # Snakemake's or a caller's root handlers would write each line twice
    return root


def get_logger(speaker: str) -> logging.Logger:
    """The logger whose lines read `[speaker] message` (a stage's name, e.g. "validate", "overfit_gate")."""
    _root()
    return logging.getLogger(f"{ROOT}.{speaker}")
