"""Code that runs inside vLLM's worker processes, loaded by module path (DESIGN.md §5).

- `HiddenStatesCapture`: the `worker_extension_cls` of the hooks path. Hooks sit where
  layers.hook_point puts each id; while a shard is open, every forward step goes to its LayerSink
  (TP rank 0 only: all ranks hold the same residual stream), which writes the layer files.
- for the built-in path, the same extension opens and finishes the shard's LayerSink, which
  connector.py's E3PHiddenStatesConnector fills (through connector.PORT, in the same process).
- `CPUHiddenStatesConnector`: vLLM's ExampleHiddenStatesConnector without pinned memory and CUDA
  streams, so the built-in `extract_hidden_states` path runs on vLLM's CPU build.

vLLM is imported lazily, so this module imports without it (the base environment's tests).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

from ...infra import faults
from ...layers import decoder_stack, hook_point
from ...vllm_common import registry
from .compat import TAG_KEY, step_layout
from .connector import PORT

if TYPE_CHECKING:
    import torch

    from ...shard.sink import LayerSink

# CPUHiddenStatesConnector is served by the module __getattr__ at the bottom.
__all__ = ["TAG_KEY", "HiddenStatesCapture"]


def _fresh_stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """HF's residual stream = hidden + residual, as a new tensor: the next layer's fused
    add+RMSNorm mutates both inputs in place (and layer 0 mutates the embedding output it was given),
    so the copy to host, which may run later on a side stream, must not read them."""
    return hidden.clone() if residual is None else hidden + residual


def _layer_stream(output: Any) -> torch.Tensor:
    """The residual stream after a vLLM decoder layer: it returns (hidden, residual)."""
    if isinstance(output, tuple):
        return _fresh_stream(output[0], output[1] if len(output) > 1 else None)
    return _fresh_stream(output, None)  # a layer without the fused residual returns the stream itself


def _layer_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The input stream of a decoder layer, from its forward(positions, hidden_states, residual)."""
    hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
    residual = args[2] if len(args) > 2 else kwargs.get("residual")
    return _fresh_stream(hidden, residual)


def _tp_rank() -> int:
    return registry.load("get_tensor_model_parallel_rank")()


class HiddenStatesCapture:
    """vLLM worker extension (LLM(worker_extension_cls="eagle3prep.backends.vllm.worker.HiddenStatesCapture")).

    Names start with `e3p_` because vLLM refuses extension attributes that clash with the Worker's.
    Driver side: collective_rpc("e3p_install_hooks", args=(layer_ids,)) once; per shard
    e3p_open_shard(SinkSpec), requests tagged with SamplingParams(extra_args={TAG_KEY: tag}), e3p_finish_shard().
    """

    def e3p_install_hooks(self, layer_ids: list[int]) -> dict[str, Any]:
        """Register the hooks once; only TP rank 0 keeps rows (all ranks hold the same stream)."""
        from . import internals  # each vLLM internal read here is checked: one line when one is missing

        self._e3p_rank = _tp_rank()
        self._e3p_step: list = []  # this forward's segments, read when layer 0 starts
        self._e3p_sink: LayerSink | None = None  # set between e3p_open_shard and e3p_finish_shard
        model = internals.require(internals.require(self, "model_runner"), "model")
        try:
            stack = decoder_stack(model)
        except ValueError:
            raise internals.missing("layers", model, "no decoder layers the hooks know; " + internals.FIX) from None
        num_layers = len(stack.layers)
        if self._e3p_rank != 0:
            return {"rank": self._e3p_rank, "num_hidden_layers": num_layers, "hooks": 0}
        # Not a hook on the stack module itself: vLLM's @support_torch_compile wrapper calls its
        # forward() directly, so module hooks there never fire. Layer 0 starts every forward.
        handles = [stack.layers[0].register_forward_pre_hook(self._e3p_on_step_start)]
        for layer_id in layer_ids:
            layer, side = hook_point(layer_id, num_layers)
            if side == "input":
                internals.check_layer_input(stack.layers[layer])
                hook = functools.partial(self._e3p_on_layer_input, layer_id)
                handles.append(stack.layers[layer].register_forward_pre_hook(hook, with_kwargs=True))
            else:
                hook = functools.partial(self._e3p_on_layer_output, layer_id)
                handles.append(stack.layers[layer].register_forward_hook(hook))
        self._e3p_handles = handles
        return {"rank": 0, "num_hidden_layers": num_layers, "hooks": len(handles)}

    def e3p_attach(self) -> dict[str, Any]:
        """The built-in path's install: no hooks; e3p_open_shard's sink goes to the connector (connector.PORT)."""
        self._e3p_rank = _tp_rank()
        self._e3p_sink = None
        return {"rank": self._e3p_rank}

    def e3p_shard_progress(self) -> dict[str, Any]:
        """Rows the connector has handed to the open shard's sink (the driver waits for all of them)."""
        return {"rank": self._e3p_rank, "tokens": PORT.tokens, "steps": PORT.steps, "last_at": PORT.last_at}

    def _e3p_on_step_start(self, module: Any, args: tuple) -> None:
        self._e3p_step = step_layout(self.model_runner)  # [] for vLLM's dummy/warm-up runs
        if self._e3p_sink is not None and self._e3p_step:
            # crash tests: an exception inside the engine core (rows= tells a shard from the probe's smoke shard)
            faults.kill_point("vllm.engine_step", rows=len(self._e3p_sink.rows))
        if self._e3p_sink is not None and self._e3p_step:
            self._e3p_sink.begin_step(self._e3p_step)

    def _e3p_on_layer_input(self, layer_id: int, module: Any, args: tuple, kwargs: dict) -> None:
        self._e3p_keep(layer_id, _layer_input(args, kwargs))

    def _e3p_on_layer_output(self, layer_id: int, module: Any, args: tuple, output: Any) -> None:
        self._e3p_keep(layer_id, _layer_stream(output))

    def _e3p_keep(self, layer_id: int, stream: torch.Tensor) -> None:
        if self._e3p_sink is not None and self._e3p_step:  # rows of an open shard go to its layer files
            self._e3p_sink.add_layer(layer_id, stream[: self._e3p_step[-1].end])

    def e3p_open_shard(self, spec: Any) -> dict[str, Any]:
        """Send every following step's rows to a LayerSink of `spec` (a SinkSpec's fields as a dict)."""
        if self._e3p_rank != 0:
            return {"rank": self._e3p_rank}
        from ...shard.sink import LayerSink, SinkSpec

        if self._e3p_sink is not None:
            self._e3p_sink.abort()
        self._e3p_sink = None
        PORT.close()
        spec = SinkSpec(
            **{
                **spec,
                "layer_paths": {int(k): v for k, v in spec["layer_paths"].items()},
                "rows": [tuple(r) for r in spec["rows"]],
            }
        )
        # The pinned slots outlive a shard: LayerSink keeps a pool of the same shape, else makes one.
        self._e3p_sink = LayerSink(spec, pool=getattr(self, "_e3p_pool", None))
        self._e3p_pool = self._e3p_sink.pool
        PORT.open(self._e3p_sink)  # the built-in path's connector writes into it (unused by the hooks)
        return {"rank": 0, "files": len(spec.layer_paths)}

    def e3p_finish_shard(self) -> dict[str, Any]:
        """Drain, seal and rename the open shard's layer files: {"entries": {layer_id: entry}} or {"error": msg}."""
        if self._e3p_rank != 0:
            return {"rank": self._e3p_rank}
        sink, self._e3p_sink = self._e3p_sink, None
        parts = PORT.part_tokens  # the built-in path's rows handed out before their request finished
        PORT.close()
        if sink is None:
            return {"rank": 0, "error": "no shard is open in the worker"}
        try:
            entries = sink.finish()
            stats = sink.stats() | ({"part_tokens": parts} if parts else {})
            return {"rank": 0, "entries": {str(k): v for k, v in entries.items()}, "stats": stats}
        except Exception as e:  # the message travels back; a raise here would kill the engine
            from ...errors import UserError

            return {"rank": 0, "error": f"{type(e).__name__}: {e}", "user_error": isinstance(e, UserError)}

    def e3p_abort_shard(self) -> dict[str, Any]:
        """Drop the open shard's temp files (the driver failed or was interrupted)."""
        if getattr(self, "_e3p_rank", 1) != 0 or self._e3p_sink is None:
            return {"rank": getattr(self, "_e3p_rank", None)}
        sink, self._e3p_sink = self._e3p_sink, None
        PORT.close()
        sink.abort()
        return {"rank": 0, "aborted": True}


class _DoneEvent:
    """Stands in for the connector's torch.cuda.Event: on CPU the copy is done when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


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
            done = _DoneEvent()
            future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
            self._req_copy_events[pending.req_id] = done
            self._req_futures[pending.req_id] = future
            future.add_done_callback(partial(self._on_write_done, pending.req_id))

    # Importable by name (module __getattr__ below), so pickle and vLLM's loader both find it.
    CPUHiddenStatesConnector.__qualname__ = "CPUHiddenStatesConnector"
    return CPUHiddenStatesConnector


def __getattr__(name: str) -> Any:
    # vLLM resolves the connector with getattr(import_module(kv_connector_module_path), name);
    # building the class lazily keeps this module importable without vLLM.
    if name == "CPUHiddenStatesConnector":
        return _cpu_connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
