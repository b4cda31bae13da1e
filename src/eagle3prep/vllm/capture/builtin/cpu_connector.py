"""vLLM's ExampleHiddenStatesConnector without pinned memory and CUDA streams, so vLLM's own built-in
`extract_hidden_states` path (its per-request files) runs on vLLM's CPU build: the benches compare against it.
Loaded by vLLM by module path (kv_connector_module_path = this module's name).

vLLM is imported lazily, so this module imports without it (the base environment's tests).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ... import registry
from ..worker import Done

CONNECTOR = "CPUHiddenStatesConnector"


@functools.cache
def _cpu_connector_class() -> type:
    from functools import partial

    import torch

    ExampleHiddenStatesConnector = registry.load("ExampleHiddenStatesConnector")  # noqa: N806 - a class
    extract_from_kv_cache = registry.load("extract_from_kv_cache")

    class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
        """ExampleHiddenStatesConnector for vLLM's CPU build.

        The stock `_submit_async_write` allocates pinned host memory and uses CUDA streams/events,
        which raise on a CPU-only torch ("pin_memory=True requires a CUDA or other accelerator
        backend"). Here the KV cache already is host memory: gather and clone synchronously, then
        hand the file write to the connector's own thread pool and lock, as the parent does.
        Mirrors vLLM 0.32's method (private API: re-check on upgrade).
        """

        def _submit_async_write(self, pending: Any) -> None:
            if not self._is_tp_rank_zero:
                return
            assert self._kv_cache is not None
            block_ids = torch.tensor(pending.block_ids, dtype=torch.long)  # [num_blocks]
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
            num_tokens = pending.token_ids.shape[0]
            # [T, L, H]; cloned because the request's blocks are freed and reused after this step.
            hidden = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).clone()
            tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}

            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is None and self.use_lock:
                import fcntl

                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            done = Done()
            future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
            self._req_copy_events[pending.req_id] = done
            self._req_futures[pending.req_id] = future
            future.add_done_callback(partial(self._on_write_done, pending.req_id))

    # Importable by name (module __getattr__ below), so pickle and vLLM's loader both find it.
    CPUHiddenStatesConnector.__qualname__ = CONNECTOR
    return CPUHiddenStatesConnector


def __getattr__(name: str) -> Any:
    # vLLM resolves the connector with getattr(import_module(kv_connector_module_path), name);
    # building the class lazily keeps this module importable without vLLM.
    if name == CONNECTOR:
        return _cpu_connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
