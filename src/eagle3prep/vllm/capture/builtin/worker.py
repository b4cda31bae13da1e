"""The built-in path's worker extension: no hooks; e3p_open_shard's sink goes to the connector (capture/worker.PORT,
in the same process), and the driver asks how many rows reached it."""

from __future__ import annotations

from typing import Any

from ..message import WorkerReply
from ..worker import PORT, ShardWorker, tp_rank


class ConnectorWorker(ShardWorker):
    """The built-in path's vLLM worker extension (path.BuiltinPath names it by its module and name)."""

    def e3p_attach(self) -> dict[str, Any]:
        """The built-in path's install: the connector finds the open shard's sink in PORT."""
        self._e3p_rank = tp_rank()
        self._e3p_sink = None
        return WorkerReply(rank=self._e3p_rank).to_wire()

    def e3p_shard_progress(self) -> dict[str, Any]:
        """Rows the connector has handed to the open shard's sink (the driver waits for all of them), and the
        sink's error once one happened (no more rows will come: the driver finishes the shard, which reports it)."""
        failure = PORT.sink.failure if PORT.sink is not None else None
        return WorkerReply(
            rank=self._e3p_rank, tokens=PORT.tokens, steps=PORT.steps, last_at=PORT.last_at, error=failure
        ).to_wire()
