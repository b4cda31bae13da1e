"""What the driver and TP rank 0's worker say to each other over LLM.collective_rpc: the shard to open (a SinkSpec)
going in, a WorkerReply coming back. Both travel as plain dicts, which vLLM's RPC serializes in every release."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .. import names, registry


@dataclass(slots=True)
class WorkerReply:
    """A worker's answer to one e3p_* call; each call fills its own fields (None: not part of that answer)."""

    rank: int | None = None  # the worker's TP rank: only rank 0 holds a sink
    files: int | None = None  # e3p_open_shard: the layer files opened
    num_hidden_layers: int | None = None  # e3p_install_hooks: the decoder layers found
    hooks: int | None = None  # e3p_install_hooks: the hooks registered
    entries: dict[str, dict[str, Any]] | None = None  # e3p_finish_shard: {layer_id: file entry}
    stats: dict[str, Any] | None = None  # e3p_finish_shard: the sink's timings
    error: str | None = None  # e3p_finish_shard (and e3p_shard_progress, early): why the layer files cannot be written
    user_error: bool | None = None  # the error is the user's to fix (a full disk): one line, no traceback
    tokens: int | None = None  # e3p_shard_progress: rows handed to the open sink
    steps: int | None = None  # e3p_shard_progress: engine steps the connector was bound to
    last_at: float | None = None  # e3p_shard_progress: when rows last reached the sink (time.monotonic)
    aborted: bool | None = None  # e3p_abort_shard: the open shard's temp files were dropped

    def to_wire(self) -> dict[str, Any]:
        """The fields this answer has, rank first."""
        return {"rank": self.rank} | {
            f.name: v
            for f in dataclasses.fields(self)
            if f.name != "rank" and (v := getattr(self, f.name)) is not None
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> WorkerReply:
        return cls(**wire)

    def layer_entries(self) -> dict[int, dict[str, Any]]:
        return {int(k): v for k, v in (self.entries or {}).items()}


def spec_to_wire(spec: Any) -> dict[str, Any]:
    """A SinkSpec as the worker receives it: its storage format by name."""
    return dataclasses.asdict(spec) | {"storage": spec.storage.name}


def spec_from_wire(wire: dict[str, Any]) -> Any:
    """The SinkSpec the driver sent: the RPC may turn int keys into strings and tuples into lists."""
    from ...shard.formats import storage_format
    from ...shard.sink import SinkSpec

    return SinkSpec(
        **{
            **wire,
            "layer_paths": {int(k): v for k, v in wire["layer_paths"].items()},
            "rows": [tuple(r) for r in wire["rows"]],
            "storage": storage_format(wire["storage"]),
        }
    )


def rpc_result(reply: Any, *, version: str, unique_reply_rank: int | None = None) -> Any:
    """The rank-0 (or `unique_reply_rank`) result of a collective_rpc call.

    - LLM.collective_rpc and executor calls without unique_reply_rank: a list, one item per worker.
    - executor.collective_rpc(unique_reply_rank=r): vLLM before names.RPC_BARE_REPLY_SINCE returns a 1-element
      list, later ones the bare result (which may itself be a list, so the shape cannot decide).
    Never truth-test a reply: on a tensor it raises, on a list of tensors it answers the wrong question.
    """
    if unique_reply_rank is not None and names.at_least(version, names.RPC_BARE_REPLY_SINCE):
        return reply
    if not isinstance(reply, list | tuple) or len(reply) == 0:
        raise RuntimeError(
            f"collective_rpc returned {type(reply).__name__} (len {len(reply) if hasattr(reply, '__len__') else '-'}); "
            f"expected one reply per worker from vLLM {version}"
        )
    return reply[0]


def call(llm: Any, method: str, *args: Any, version: str) -> WorkerReply:
    """TP rank 0's worker's reply to the worker extension's `method`."""
    collective_rpc = registry.member(llm, "LLM.collective_rpc", version=version)
    return WorkerReply.from_wire(rpc_result(collective_rpc(method, args=args), version=version))
