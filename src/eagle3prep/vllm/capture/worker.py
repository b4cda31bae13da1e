"""What both capture paths run inside vLLM's worker processes (DESIGN.md §5): the open shard's LayerSink, opened,
finished and aborted by the driver's e3p_* calls (capture/message.py), on TP rank 0 only (all ranks hold the same
residual stream). Each path's worker extension (hooks/worker.py, builtin/worker.py) adds how rows reach the sink.

vLLM is imported lazily, so this module imports without it (the base environment's tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import registry
from .message import WorkerReply, spec_from_wire

if TYPE_CHECKING:
    from ...shard.sink import LayerSink


class Done:
    """A copy event already complete, where a torch.cuda.Event would stand on a GPU: on a CPU a copy is done when it
    returns (and with no sink open nothing is copied)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class ShardPort:
    """Where the worker extension puts the open shard's sink, and the built-in path's connector finds it: both live
    in TP rank 0's worker process."""

    def __init__(self) -> None:
        self.close()

    def open(self, sink: LayerSink) -> None:
        self.close()
        self.sink = sink

    def close(self) -> None:
        self.sink: LayerSink | None = None
        self.tokens = 0  # rows handed to the open sink (the driver waits for all of them)
        self.part_tokens = 0  # of which in parts of requests still being prefilled (builtin/prefill_parts.PartSave)
        # For the shard's tail (the driver's drain): steps the connector was bound to, and when (time.monotonic,
        # one clock for the host's processes) rows last reached the sink
        self.steps = 0
        self.last_at = 0.0


PORT = ShardPort()


def tp_rank() -> int:
    return registry.load("get_tensor_model_parallel_rank")()


class ShardWorker:
    """The shard half of a vLLM worker extension. Names start with `e3p_` because vLLM refuses extension attributes
    that clash with the Worker's. A subclass's install call sets `_e3p_rank` and `_e3p_sink` first."""

    _e3p_rank: int
    _e3p_sink: LayerSink | None

    def e3p_open_shard(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Send every following step's rows to a LayerSink of `spec` (message.spec_to_wire's dict)."""
        if self._e3p_rank != 0:
            return WorkerReply(rank=self._e3p_rank).to_wire()
        from ...shard.sink import LayerSink

        if self._e3p_sink is not None:
            self._e3p_sink.abort()
        self._e3p_sink = None
        PORT.close()
        sink_spec = spec_from_wire(spec)
        # The pinned slots outlive a shard: LayerSink keeps a pool of the same shape, else makes one.
        self._e3p_sink = LayerSink(sink_spec, pool=getattr(self, "_e3p_pool", None))
        self._e3p_pool = self._e3p_sink.pool
        PORT.open(self._e3p_sink)  # the built-in path's connector writes into it (unused by the hooks)
        return WorkerReply(rank=0, files=len(sink_spec.layer_paths)).to_wire()

    def e3p_finish_shard(self) -> dict[str, Any]:
        """Drain, seal and rename the open shard's layer files: its entries, or the error."""
        if self._e3p_rank != 0:
            return WorkerReply(rank=self._e3p_rank).to_wire()
        sink, self._e3p_sink = self._e3p_sink, None
        parts = PORT.part_tokens  # the built-in path's rows handed out before their request finished
        PORT.close()
        if sink is None:
            return WorkerReply(rank=0, error="no shard is open in the worker").to_wire()
        try:
            entries = sink.finish()
            stats = sink.stats() | ({"part_tokens": parts} if parts else {})
            return WorkerReply(rank=0, entries={str(k): v for k, v in entries.items()}, stats=stats).to_wire()
        except Exception as e:  # the message travels back; a raise here would kill the engine
            import traceback

            from ...errors import UserError

            if not isinstance(e, UserError):  # the job's log keeps where it came from; the driver says one line
                traceback.print_exception(e)
            error = f"{type(e).__name__}: {e}"
            return WorkerReply(rank=0, error=error, user_error=isinstance(e, UserError)).to_wire()

    def e3p_abort_shard(self) -> dict[str, Any]:
        """Drop the open shard's temp files (the driver failed or was interrupted)."""
        rank = getattr(self, "_e3p_rank", None)  # an engine that failed before its install call has none
        if rank != 0 or self._e3p_sink is None:
            return WorkerReply(rank=rank).to_wire()
        sink, self._e3p_sink = self._e3p_sink, None
        PORT.close()
        sink.abort()
        return WorkerReply(rank=0, aborted=True).to_wire()
