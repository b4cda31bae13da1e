"""The hooks path's worker extension, inside vLLM's worker processes (DESIGN.md §5): hooks sit where
layers.hook_point puts each id; while a shard is open, every forward step goes to its LayerSink on TP rank 0
(capture/worker.py), which writes the layer files.

vLLM is imported lazily, so this module imports without it (the base environment's tests).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ....infra import faults
from ....layers import decoder_stack, hook_point
from ..message import WorkerReply
from ..worker import ShardWorker, tp_rank
from . import internals

if TYPE_CHECKING:
    import torch

    from ....shard.sink import LayerSink


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


class HiddenStatesCapture(ShardWorker):
    """The hooks path's vLLM worker extension (path.HooksPath names it by its module and name).

    Driver side: collective_rpc("e3p_install_hooks", args=(layer_ids,)) once; per shard
    e3p_open_shard(SinkSpec), requests tagged with SamplingParams(extra_args={TAG_KEY: tag}), e3p_finish_shard().
    """

    def e3p_install_hooks(self, layer_ids: list[int]) -> dict[str, Any]:
        """Register the hooks once; only TP rank 0 keeps rows (all ranks hold the same stream)."""
        self._e3p_rank = tp_rank()
        self._e3p_step: list = []  # this forward's segments, read when layer 0 starts
        self._e3p_sink: LayerSink | None = None  # set between e3p_open_shard and e3p_finish_shard
        model = internals.require(internals.require(self, "model_runner"), "model")
        try:
            stack = decoder_stack(model)
        except ValueError:
            raise internals.missing("layers", model, "no decoder layers the hooks know; " + internals.FIX) from None
        num_layers = len(stack.layers)
        if self._e3p_rank != 0:
            return WorkerReply(rank=self._e3p_rank, num_hidden_layers=num_layers, hooks=0).to_wire()
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
        return WorkerReply(rank=0, num_hidden_layers=num_layers, hooks=len(handles)).to_wire()

    def _e3p_on_step_start(self, module: Any, args: tuple) -> None:
        # [] for vLLM's dummy/warm-up runs
        self._e3p_step = internals.step_layout(internals.require(self, "model_runner"))
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
