"""The built-in path, driver side: vLLM's `extract_hidden_states` speculative method + our hidden-states KV
connector (connector.py, loaded by kv_connector_module_path): TP rank 0's worker gathers each finished request's
rows from vLLM's hidden-states cache into the shard's sink. No per-request file."""

from __future__ import annotations

import time
from typing import Any

from ... import registry
from .. import loop, message
from ..feed import ShardRun, log
from ..loop import WorkerSinkPath
from . import connector
from .worker import ConnectorWorker

CONNECTOR_MODULE = connector.__name__  # vLLM imports it by name
WORKER_EXTENSION = f"{ConnectorWorker.__module__}.{ConnectorWorker.__qualname__}"
DRAIN_S = 600  # a shard's last rows reach the worker a step after their request ends: seconds, not minutes


class BuiltinPath(WorkerSinkPath):
    """extract_hidden_states + our connector: TP rank 0's worker writes the layer files."""

    name = "builtin"

    def engine_kwargs(self) -> dict[str, Any]:
        # No lock files: nothing outside the worker waits for a request's rows. Compiled graphs are fine:
        # vLLM's own extract_hidden_states model writes the buffer, no module hook is involved.
        extra = {"use_synchronization_lock": False}
        return {
            "speculative_config": {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(self.layer_ids)}},
            },
            "kv_transfer_config": {
                "kv_connector": connector.CONNECTOR,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": extra,
            },
            "worker_extension_cls": WORKER_EXTENSION,
        }

    def install(self, llm: Any) -> None:
        reply = message.call(llm, "e3p_attach", version=self.version)
        log(f"hidden-states connector attached on rank {reply.rank}")

    def wait_for_rows(self, llm: Any, run: ShardRun) -> None:
        """A finished request's rows reach the connector one engine step after the driver sees it end.
        A multiprocess engine steps on its own until they are sent; an in-process one is stepped here."""
        total = run.spec.total_tokens
        inproc = loop.engine_in_process(run.engine)
        start, first = time.monotonic(), None
        deadline = start + DRAIN_S
        while True:
            reply = message.call(llm, "e3p_shard_progress", version=self.version)
            first, got = first or reply, reply.tokens
            if reply.error is not None:  # the sink failed (out of GPU memory, say): no more rows will come
                return
            if got >= total:
                # where the drain went: the connector's steps meanwhile, and how long after it began the last rows
                # reached the sink (the rest of drain_s is this loop's polling)
                run.clock["drain_steps"] = (reply.steps or 0) - (first.steps or 0)
                run.clock["drain_lag_s"] = max(0.0, (reply.last_at or 0.0) - start)
                return
            if time.monotonic() > deadline:
                # the worker reported no error: one line (WorkerFailure) pointing at the engine's own log lines
                raise loop.WorkerError(f"{got} of the shard's {total} rows reached the worker's sink in {DRAIN_S} s")
            if inproc:
                registry.member(run.engine, "LLMEngine.step", version=self.version)()
            else:
                time.sleep(0.002)
