"""Code that runs inside vLLM's worker processes, loaded by module path.

- `HiddenStatesCapture`: a `worker_extension_cls` (the hooks capture path). Forward hooks on the
  decoder layers take `hidden + residual` at the requested layer ids; the rows of each forward step
  are split by request (the model runner's input batch and query_start_loc say which tokens belong to
  which request) and kept per request until the driver asks for them; then TP rank 0 writes them to
  a safetensors file. Tensors never travel through collective_rpc replies (they arrive mangled
  unless VLLM_ALLOW_INSECURE_SERIALIZATION=1).
- `CPUHiddenStatesConnector`: vLLM's ExampleHiddenStatesConnector without pinned memory and CUDA
  streams, so the built-in `extract_hidden_states` path runs on vLLM's CPU build.

vLLM is imported lazily, so `import eagle3prep.vllm_ext` works without it (the row bookkeeping,
`RowAccumulator`, is plain torch and unit-tested in the base environment).
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from .vllm_compat import TAG_KEY, step_layout

if TYPE_CHECKING:
    import torch

    from .sink import ShardSink

# CPUHiddenStatesConnector is served by the module __getattr__ at the bottom.
__all__ = ["HiddenStatesCapture", "RowAccumulator", "TAG_KEY"]


class RowAccumulator:
    """Rows of each request, collected over forward steps (chunked prefill splits a prompt).

    add(tag, start_pos, {layer_id: [n, H]}) once per step and request; take(tags, lengths) returns
    {layer_id: [sum_T, H]} in `tags` order, after checking that every request's chunks cover
    positions 0..length-1 exactly once (a prefix-cache hit or a lost chunk would leave a gap).
    """

    def __init__(self) -> None:
        # tag -> list of (start_pos, {layer_id: [n, H]})
        self._chunks: dict[str, list[tuple[int, dict[int, torch.Tensor]]]] = defaultdict(list)

    def add(self, tag: str, start_pos: int, rows: dict[int, torch.Tensor]) -> None:
        self._chunks[tag].append((start_pos, rows))

    def tags(self) -> list[str]:
        return list(self._chunks)

    def clear(self) -> None:
        self._chunks.clear()

    def take(self, tags: list[str], lengths: list[int]) -> dict[int, torch.Tensor]:
        import torch

        missing = [t for t in tags if t not in self._chunks]
        if missing:
            raise RuntimeError(
                f"no captured rows for request tag(s) {missing[:5]} (captured: {self.tags()[:5]}); "
                "the hooks did not see these requests: is this TP rank 0 and enforce_eager=True?"
            )
        per_row = [self._assemble(tag, length) for tag, length in zip(tags, lengths, strict=True)]
        for tag in tags:
            del self._chunks[tag]
        layer_ids = sorted(per_row[0]) if per_row else []
        return {i: torch.cat([row[i] for row in per_row]) for i in layer_ids}  # [sum_T, H]

    def _assemble(self, tag: str, length: int) -> dict[int, torch.Tensor]:
        """One request's rows in position order, [length, H] per layer."""
        import torch

        chunks = sorted(self._chunks[tag], key=lambda c: c[0])
        covered = 0
        parts: list[dict[int, torch.Tensor]] = []
        for start, rows in chunks:
            n = next(iter(rows.values())).shape[0]
            if start >= length:
                continue  # a decode step after the prompt (the one sampled token): not a prompt row
            if start != covered:
                raise RuntimeError(
                    f"request {tag}: captured positions jump from {covered} to {start} "
                    f"(prompt length {length}); prefix caching must be off and every chunk captured"
                )
            keep = min(n, length - start)
            parts.append({i: t[:keep] for i, t in rows.items()})
            covered += keep
        if covered != length:
            raise RuntimeError(f"request {tag}: captured {covered} of {length} prompt positions")
        return {i: torch.cat([p[i] for p in parts]) for i in parts[0]}


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


def _decoder_stack(model: Any) -> Any:
    """The module that owns `.layers` (model.model for Llama-style; the language model of a VLM)."""
    if hasattr(model, "get_language_model"):
        model = model.get_language_model()
    for candidate in (getattr(model, "model", None), model):
        if candidate is not None and hasattr(candidate, "layers"):
            return candidate
    raise RuntimeError(f"cannot find the decoder layers of {type(model).__name__} (no .model.layers)")


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class HiddenStatesCapture:
    """vLLM worker extension (LLM(worker_extension_cls="eagle3prep.vllm_ext.HiddenStatesCapture")).

    Names start with `e3p_` because vLLM refuses extension attributes that clash with the Worker's.
    Driver side:  collective_rpc("e3p_install_hooks", args=(layer_ids,)), then LLM.generate(...) with
    SamplingParams(extra_args={TAG_KEY: tag}), then collective_rpc("e3p_write", args=(path, tags, lengths)).
    """

    def e3p_install_hooks(self, layer_ids: list[int]) -> dict[str, Any]:
        """Register the hooks once; only TP rank 0 keeps rows (all ranks hold the same stream)."""
        self._e3p_rank = _tp_rank()
        self._e3p_rows = RowAccumulator()
        self._e3p_step: list = []  # this forward's segments, read when layer 0 starts
        self._e3p_sink: ShardSink | None = None  # set between e3p_open_shard and e3p_finish_shard
        stack = _decoder_stack(self.model_runner.model)
        num_layers = len(stack.layers)
        if self._e3p_rank != 0:
            return {"rank": self._e3p_rank, "num_hidden_layers": num_layers, "hooks": 0}

        bad = [i for i in layer_ids if not 0 <= i <= num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} outside 0..{num_layers} for this model")
        self._e3p_layer_ids = list(layer_ids)
        self._e3p_pending: dict[int, torch.Tensor] = {}  # layer_id -> [num_tokens, H] of this step
        # Not a hook on the stack module itself: vLLM's @support_torch_compile wrapper calls its
        # forward() directly, so module hooks there never fire. Layer 0 starts every forward.
        handles = [stack.layers[0].register_forward_pre_hook(self._e3p_on_step_start)]
        for layer_id in layer_ids:
            if layer_id == 0:  # the embedding output = input of layer 0
                hook = functools.partial(self._e3p_on_layer_input, layer_id)
                handles.append(stack.layers[0].register_forward_pre_hook(hook, with_kwargs=True))
            else:  # input of layer k = output of layer k-1; id N = output of the last layer (pre-norm)
                hook = functools.partial(self._e3p_on_layer_output, layer_id)
                handles.append(stack.layers[layer_id - 1].register_forward_hook(hook))
        # The hook that completes a step is the one on the deepest layer (hooks fire in layer order).
        self._e3p_last_id = max(layer_ids)
        self._e3p_handles = handles
        return {"rank": 0, "num_hidden_layers": num_layers, "hooks": len(handles)}

    def _e3p_on_step_start(self, module: Any, args: tuple) -> None:
        self._e3p_step = step_layout(self.model_runner)  # [] for vLLM's dummy/warm-up runs
        self._e3p_pending = {}
        if self._e3p_sink is not None and self._e3p_step:
            self._e3p_sink.begin_step(self._e3p_step)

    def _e3p_on_layer_input(self, layer_id: int, module: Any, args: tuple, kwargs: dict) -> None:
        self._e3p_keep(layer_id, _layer_input(args, kwargs))

    def _e3p_on_layer_output(self, layer_id: int, module: Any, args: tuple, output: Any) -> None:
        self._e3p_keep(layer_id, _layer_stream(output))

    def _e3p_keep(self, layer_id: int, stream: torch.Tensor) -> None:
        if not self._e3p_step:
            return
        total = self._e3p_step[-1].end
        if self._e3p_sink is not None:  # a shard is open: rows go straight to its layer files
            self._e3p_sink.add_layer(layer_id, stream[:total])
            return
        # [total, H] model dtype; copied to host now because vLLM reuses these buffers next step.
        self._e3p_pending[layer_id] = stream[:total].detach().to("cpu", copy=True)
        if layer_id != self._e3p_last_id:
            return
        for seg in self._e3p_step:  # split the flattened step into its requests
            rows = {i: t[seg.start : seg.end] for i, t in self._e3p_pending.items()}
            self._e3p_rows.add(seg.tag, seg.first_pos, rows)
        self._e3p_pending = {}

    def e3p_write(self, path: str, tags: list[str], lengths: list[int]) -> dict[str, Any]:
        """Write the rows of `tags` (in that order) to `path`: layer_{id} [sum_T, H], lengths [B]."""
        if self._e3p_rank != 0:
            return {"rank": self._e3p_rank}
        import torch
        from safetensors.torch import save_file

        layers = self._e3p_rows.take(list(tags), list(lengths))
        tensors = {f"layer_{i}": t.contiguous() for i, t in layers.items()}
        tensors["lengths"] = torch.tensor(list(lengths), dtype=torch.int64)
        tmp = f"{path}.tmp-{os.getpid()}"
        save_file(tensors, tmp)
        os.replace(tmp, path)  # the driver never sees a half-written file
        return {"rank": 0, "path": path, "tokens": int(sum(lengths))}

    def e3p_open_shard(self, shard: dict[str, Any]) -> dict[str, Any]:
        """Send every following step's rows to a shard's layer files (rank 0 writes them).

        `shard`: layer_paths {layer_id: final path}, hidden_size, dtype, rows [[tag, offset, length]],
        total_tokens, step_tokens (the scheduler's token budget: the host slots' size), slots.
        """
        if self._e3p_rank != 0:
            return {"rank": self._e3p_rank}
        import torch

        from .shard import FLUSH_EVERY
        from .sink import RowPlacement, ShardSink, SlotPool

        if self._e3p_sink is not None:
            self._e3p_sink.abort()
        self._e3p_sink = None
        paths = {int(k): v for k, v in shard["layer_paths"].items()}
        key = (len(paths), int(shard["hidden_size"]), getattr(torch, shard["dtype"]), int(shard["step_tokens"]))
        pool = getattr(self, "_e3p_pool", None)
        if pool is None or pool.key != (*key, int(shard.get("slots", 3))):  # pinned slots outlive a shard
            pool = self._e3p_pool = SlotPool(*key, size=int(shard.get("slots", 3)))
        self._e3p_sink = ShardSink(
            paths,
            hidden_size=int(shard["hidden_size"]),
            dtype=shard["dtype"],
            rows={tag: RowPlacement(int(off), int(n)) for tag, off, n in shard["rows"]},
            total_tokens=int(shard["total_tokens"]),
            step_tokens=int(shard["step_tokens"]),
            pool=pool,
            sync_bytes=int(shard.get("sync_bytes", FLUSH_EVERY)),
        )
        return {"rank": 0, "files": len(paths)}

    def e3p_finish_shard(self) -> dict[str, Any]:
        """Drain and seal the open shard's layer files: {"entries": {layer_id: entry}} or {"error": msg}."""
        if self._e3p_rank != 0:
            return {"rank": self._e3p_rank}
        sink, self._e3p_sink = self._e3p_sink, None
        if sink is None:
            return {"rank": 0, "error": "no shard is open in the worker"}
        try:
            entries = sink.finish()
            return {"rank": 0, "entries": {str(k): v for k, v in entries.items()}, "stats": sink.stats()}
        except Exception as e:  # the message travels back; a raise here would kill the engine
            from .errors import UserError

            return {"rank": 0, "error": f"{type(e).__name__}: {e}", "user_error": isinstance(e, UserError)}

    def e3p_abort_shard(self) -> dict[str, Any]:
        """Drop the open shard's temp files (the driver failed or was interrupted)."""
        if getattr(self, "_e3p_rank", 1) != 0 or self._e3p_sink is None:
            return {"rank": getattr(self, "_e3p_rank", None)}
        sink, self._e3p_sink = self._e3p_sink, None
        sink.abort()
        return {"rank": 0, "aborted": True}

    def e3p_reset(self) -> dict[str, Any]:
        """Drop rows nobody asked for (e.g. after a failed generate)."""
        dropped = self._e3p_rows.tags() if getattr(self, "_e3p_rank", 1) == 0 else []
        if dropped:
            self._e3p_rows.clear()
        return {"dropped": len(dropped)}


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
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        extract_from_kv_cache,
    )

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
