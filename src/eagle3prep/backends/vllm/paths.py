"""The two ways vLLM hands hidden states over, each writing through a LayerSink (DESIGN.md §5).

- hooks: forward hooks in the worker extension (worker.py); TP rank 0's worker runs the sink, the
  driver streams the requests in and asks the worker to finish.
- builtin: vLLM's `extract_hidden_states` speculative method + the hidden-states KV connector, one
  file per request (named by our tag where vLLM >= 0.24 allows it); the driver runs the sink and
  writes each request's rows as its file arrives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import UserError
from ...shard.sink import LayerSink
from . import compat

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

    from ...shard.sink import SinkSpec

EXT_MODULE = "eagle3prep.backends.vllm.worker"


def log(msg: str) -> None:
    print(f"[vllm backend] {msg}", file=sys.stderr)


class CaptureError(RuntimeError):
    """The engine returned hidden states that do not match the request (layers, shapes, tokens)."""


class WorkerUserError(UserError):
    """A UserError raised in the vLLM worker (a full disk), passed on with its message."""


def sampling_params(tag: str, extra: dict[str, Any] | None = None, logprobs: bool = False) -> Any:
    from vllm import SamplingParams

    # One output token: the prompt's forward is all we need. The tag lets the worker (hooks) and
    # the file name (builtin) attribute rows to requests whatever ids vLLM assigns internally.
    # prompt_logprobs=0: the logprob of each actual prompt token (validate's logits check).
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        extra_args={compat.TAG_KEY: tag, **(extra or {})},
        **({"prompt_logprobs": 0} if logprobs else {}),
    )


def prompt_logprobs(out: Any, ids: list[int]) -> Any:
    """[T-1] float32 logprobs of tokens 1.. of a finished request (vLLM's position 0 has none)."""
    import torch

    per_pos = out.prompt_logprobs or []
    if len(per_pos) != len(ids):
        raise CaptureError(f"request {out.request_id}: {len(per_pos)} prompt logprobs for {len(ids)} tokens")
    return torch.tensor([per_pos[t][ids[t]].logprob for t in range(1, len(ids))], dtype=torch.float32)


def _read_request_file(path: str) -> dict[str, torch.Tensor]:
    """Load one connector file, waiting for its writer thread (vLLM >= 0.22 holds a flock on .lock)."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)  # sleeps until the writer releases LOCK_EX
            data = load_file(path)
    else:
        data = load_file(path)
    for p in (path, lock):
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)
    return data


class BuiltinPath:
    """extract_hidden_states + hidden-states connector; one safetensors file per request."""

    name = "builtin"

    def __init__(self, layer_ids: list[int], staging: Path, version: str, on_cpu: bool):
        self.layer_ids = layer_ids
        self.staging = staging
        self.version = version
        self.custom_path = compat.custom_save_path_supported(version)
        self.on_cpu = on_cpu
        self.stats: dict[str, Any] = {}
        self.logprobs: dict[int, Any] = {}

    def engine_kwargs(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"shared_storage_path": str(self.staging)}
        if self.custom_path:
            extra["allow_custom_save_path"] = True  # our request names its file (trusted: our own process)
        connector = {"kv_connector": "ExampleHiddenStatesConnector"}
        if self.on_cpu:  # the stock connector needs pinned memory and CUDA streams
            connector = {"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": EXT_MODULE}
        return {
            "speculative_config": {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(self.layer_ids)}},
            },
            "kv_transfer_config": {**connector, "kv_role": "kv_producer", "kv_connector_extra_config": extra},
        }

    def install(self, llm: Any) -> None:
        pass

    def capture_shard(self, llm: Any, batches: Iterator[list[list[int]]], spec: SinkSpec) -> dict[int, dict[str, Any]]:
        """Batch by batch through LLM.generate; each request's file goes to the sink, here."""
        from vllm import TokensPrompt

        sink = LayerSink(spec)
        self.logprobs: dict[int, Any] = {}
        try:
            first = 0
            for batch in batches:
                tags = [spec.tag(first + i) for i in range(len(batch))]
                first += len(batch)
                rows = range(first - len(batch), first)
                params = [
                    sampling_params(t, self._file_params(t), r in spec.logprob_rows)
                    for t, r in zip(tags, rows, strict=True)
                ]
                prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in batch]
                outs = llm.generate(prompts, params, use_tqdm=False)
                for out, ids, tag, r in zip(outs, batch, tags, rows, strict=True):
                    sink.write_rows(tag, self._rows(out, ids, tag))
                    if r in spec.logprob_rows:
                        self.logprobs[r] = prompt_logprobs(out, ids)
            return sink.finish()
        except BaseException:
            sink.abort()
            raise

    def _file_params(self, tag: str) -> dict[str, Any] | None:
        if not self.custom_path:
            return None
        return {"kv_transfer_params": {"hidden_states_path": str(self.staging / f"{tag}.safetensors")}}

    def _rows(self, out: Any, ids: list[int], tag: str) -> dict[int, torch.Tensor]:
        """{layer_id: [T, H]} of one request, checked against its tokens and the requested layers."""
        import torch

        data = _read_request_file(self._file_of(out, tag))
        hs, tok = data["hidden_states"], data["token_ids"]  # [T, L, H], [T]
        if not torch.equal(tok.to(torch.int64), torch.tensor(ids, dtype=torch.int64)):
            raise CaptureError(f"request {tag}: the file's token_ids differ from the row's input_ids")
        if hs.dim() != 3 or hs.shape[1] != len(self.layer_ids) or hs.shape[0] != len(ids):
            raise CaptureError(
                f"request {tag}: hidden_states {tuple(hs.shape)}, expected [{len(ids)}, {len(self.layer_ids)}, H] "
                f"for layer ids {self.layer_ids}"
            )
        return {lid: hs[:, j].contiguous() for j, lid in enumerate(self.layer_ids)}  # slots follow the ascending ids

    def _file_of(self, out: Any, tag: str) -> str:
        """The request's file, from its kv_transfer_params (named by our tag when vLLM allows it)."""
        params = getattr(out, "kv_transfer_params", None) or {}
        path = params.get("hidden_states_path")
        if path is None:
            raise CaptureError(
                f"request {tag}: vLLM returned no kv_transfer_params['hidden_states_path'] "
                "(is the hidden-states connector configured?)"
            )
        if self.custom_path and Path(path) != self.staging / f"{tag}.safetensors":
            raise CaptureError(f"request {tag}: vLLM wrote {path}, not the path the request named")
        return path


class HooksPath:
    """Forward hooks in the worker extension; TP rank 0's worker writes the layer files."""

    name = "hooks"

    def __init__(self, layer_ids: list[int], version: str):
        self.layer_ids = layer_ids
        self.version = version
        self.window_tokens = 0  # set by the driver once the engine's step size is known
        self.logprobs: dict[int, Any] = {}
        self.stats: dict[str, Any] = {}  # the worker's sink timings of the last shard

    def engine_kwargs(self) -> dict[str, Any]:
        # Hooks need eager mode: compiled graphs (torch.compile, CUDA graphs) bypass module hooks.
        return {"worker_extension_cls": f"{EXT_MODULE}.HiddenStatesCapture", "enforce_eager": True}

    def install(self, llm: Any) -> None:
        reply = compat.rpc_result(
            llm.collective_rpc("e3p_install_hooks", args=(self.layer_ids,)), version=self.version
        )
        log(f"hooks installed on rank 0: {reply}")

    def capture_shard(self, llm: Any, batches: Iterator[list[list[int]]], spec: SinkSpec) -> dict[int, dict[str, Any]]:
        """Rows are fed to the engine as a stream, at most `window_tokens` prompt tokens in flight,
        so the scheduler always has a full step and no batch boundary leaves the GPU idle."""
        from vllm import TokensPrompt

        compat.rpc_result(llm.collective_rpc("e3p_open_shard", args=(dataclasses.asdict(spec),)), version=self.version)
        engine = llm.llm_engine
        in_flight = submitted = 0
        finished = False
        self.logprobs, wanted = {}, {spec.tag(r): r for r in spec.logprob_rows}
        try:
            for batch in batches:
                for ids in batch:
                    tag = spec.tag(submitted)
                    params = sampling_params(tag, logprobs=tag in wanted)
                    engine.add_request(tag, TokensPrompt(prompt_token_ids=list(ids)), params)
                    submitted += 1
                    in_flight += len(ids)
                while in_flight > self.window_tokens:
                    in_flight -= self._step(engine, wanted)
            while engine.has_unfinished_requests():
                in_flight -= self._step(engine, wanted)
            if submitted != len(spec.rows):
                raise CaptureError(f"the shard has {len(spec.rows)} rows, {submitted} were read from its batches")
            reply = compat.rpc_result(llm.collective_rpc("e3p_finish_shard"), version=self.version)
            finished = True
        finally:
            if not finished:  # interrupted or failed: drop the requests and the worker's temp files
                with contextlib.suppress(Exception):
                    engine.abort_request([spec.tag(i) for i in range(submitted)])
                with contextlib.suppress(Exception):
                    llm.collective_rpc("e3p_abort_shard")
        if "error" in reply:
            message = f"the worker could not write the shard's layer files: {reply['error']}"
            if reply.get("user_error"):  # e.g. the disk filled up: one line for the user, no traceback
                raise WorkerUserError(message)
            raise CaptureError(message)
        self.stats = {"window_tokens": self.window_tokens, **reply.get("stats", {})}
        return {int(k): v for k, v in reply["entries"].items()}

    def _step(self, engine: Any, wanted: dict[str, int]) -> int:
        """One engine step; the prompt tokens of the requests it finished (their logprobs kept if wanted)."""
        done = 0
        for out in engine.step():
            if out.finished:
                done += len(out.prompt_token_ids or ())
                if wanted and out.request_id in wanted:
                    self.logprobs[wanted[out.request_id]] = prompt_logprobs(out, list(out.prompt_token_ids))
        return done
