"""Stopping a vLLM engine, the same way for the extract backend and the regenerate stage (and the gate, which
starts the regenerate stage's engine)."""

from __future__ import annotations

import contextlib
import gc
from typing import Any

from ..infra import shm


def shutdown_engine(owner: Any) -> None:
    """Stop `owner.llm` (a vLLM LLM; None: nothing to stop) and drop it. The engine core and its workers stop,
    the collection frees what this process held of it (the attribute is cleared first, so nothing here keeps it),
    and the record of its /dev/shm segments is dropped (infra/shm.forget_engine). An error from vLLM's own shutdown
    is ignored: the job drops the engine either way."""
    if owner.llm is None:
        return
    with contextlib.suppress(Exception):
        owner.llm.llm_engine.engine_core.shutdown()
    owner.llm = None
    gc.collect()
    shm.forget_engine()
