"""vLLM capture backend (DESIGN.md §5): tensor parallel, two capture paths behind one interface.

- builtin: vLLM's `extract_hidden_states` speculative method + the hidden-states KV connector
  (vLLM >= 0.18; id N on the DeepSeek-V2/V3/Kimi backbone only from 0.25). Each request's file is
  staged on disk (named by our request tag where vLLM >= 0.24 allows it), read, checked and removed.
- hooks: the worker extension `eagle3prep.vllm_ext.HiddenStatesCapture`, whose forward hooks split
  every forward step by request. For a shard (capture_shard, what extract_shard uses), the driver
  streams the rows into the engine and TP rank 0's worker writes the layer files itself
  (sink.ShardSink: pinned slots, side-stream copies, one writer thread per file); capture(batch),
  used by the smoke test, returns rows through one file per batch instead.

probe() picks the path (extract.capture_path: auto | builtin | hooks), starts the engine and runs a
one-prompt smoke capture at the real TP size, so a wrong layer count stops the job before its real
work, with the vLLM version and the fix in the message.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import vllm_compat as compat
from ..config import ConfigError
from ..errors import UserError
from ..layers import check_layer_ids
from .base import CaptureBackend, CaptureSpec
from .vllm_errors import ChildOutput, EngineError, engine_error

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import torch

    from ..records import IndexEntry

SMOKE_TOKENS = 16  # length of the smoke-capture prompt
# Pinned host slots of the hooks path, each one forward step of every requested layer (8B shape,
# 16k-token steps: 512 MiB): one being filled, up to two with the writer threads. Host memory is
# this, whatever the shard's size (docs/performance.md).
HOST_SLOTS = 3
EXT_MODULE = "eagle3prep.vllm_ext"


def log(msg: str) -> None:
    print(f"[vllm backend] {msg}", file=sys.stderr)


class CaptureError(RuntimeError):
    """The engine returned hidden states that do not match the request (layers, shapes, tokens)."""


class WorkerUserError(UserError):
    """A UserError raised in the vLLM worker (a full disk), passed on with its message."""


def _sampling_params(tag: str, extra: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    # One output token: the prompt's forward is all we need. The tag lets the worker (hooks) and
    # the file name (builtin) attribute rows to requests whatever ids vLLM assigns internally.
    return SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, extra_args={compat.TAG_KEY: tag, **(extra or {})}
    )


def _prompts(batch: list[list[int]]) -> list[Any]:
    from vllm import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(ids)) for ids in batch]


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

    def capture(self, llm: Any, batch: list[list[int]], tags: list[str]) -> dict[int, torch.Tensor]:
        import torch

        params = []
        for tag in tags:
            extra = {"kv_transfer_params": {"hidden_states_path": str(self.staging / f"{tag}.safetensors")}}
            params.append(_sampling_params(tag, extra if self.custom_path else None))
        outputs = llm.generate(_prompts(batch), params, use_tqdm=False)
        per_layer: dict[int, list[torch.Tensor]] = {i: [] for i in self.layer_ids}
        for out, ids, tag in zip(outputs, batch, tags, strict=True):
            data = _read_request_file(self._file_of(out, tag))
            hs, tok = data["hidden_states"], data["token_ids"]  # [T, L, H], [T]
            if not torch.equal(tok.to(torch.int64), torch.tensor(ids, dtype=torch.int64)):
                raise CaptureError(f"request {tag}: the file's token_ids differ from the row's input_ids")
            if hs.dim() != 3 or hs.shape[1] != len(self.layer_ids) or hs.shape[0] != len(ids):
                raise CaptureError(
                    f"request {tag}: hidden_states {tuple(hs.shape)}, expected [{len(ids)}, {len(self.layer_ids)}, H] "
                    f"for layer ids {self.layer_ids}"
                )
            for j, layer_id in enumerate(self.layer_ids):  # slots follow the (ascending) requested ids
                per_layer[layer_id].append(hs[:, j])
        return {i: torch.cat(rows) for i, rows in per_layer.items()}  # [sum_T, H]

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
    """LLM.generate + forward hooks in the worker extension; one file per batch from TP rank 0."""

    name = "hooks"

    def __init__(self, layer_ids: list[int], staging: Path, version: str):
        self.layer_ids = layer_ids
        self.staging = staging
        self.version = version
        self._files = itertools.count()
        self.stats: dict[str, float] = {}  # the worker's sink timings of the last shard

    def engine_kwargs(self) -> dict[str, Any]:
        # Hooks need eager mode: compiled graphs (torch.compile, CUDA graphs) bypass module hooks.
        return {"worker_extension_cls": f"{EXT_MODULE}.HiddenStatesCapture", "enforce_eager": True}

    def install(self, llm: Any) -> None:
        reply = compat.rpc_result(
            llm.collective_rpc("e3p_install_hooks", args=(self.layer_ids,)), version=self.version
        )
        log(f"hooks installed on rank 0: {reply}")

    def capture(self, llm: Any, batch: list[list[int]], tags: list[str]) -> dict[int, torch.Tensor]:
        from safetensors.torch import load_file

        try:
            llm.generate(_prompts(batch), [_sampling_params(tag) for tag in tags], use_tqdm=False)
        except BaseException:
            llm.collective_rpc("e3p_reset")  # rows of a failed batch must not leak into the next
            raise
        path = self.staging / f"hooks-{os.getpid()}-{next(self._files)}.safetensors"
        lengths = [len(ids) for ids in batch]
        # The bytes go worker -> disk -> here; the RPC reply is a small dict.
        compat.rpc_result(llm.collective_rpc("e3p_write", args=(str(path), tags, lengths)), version=self.version)
        data = load_file(path)
        path.unlink()
        if data["lengths"].tolist() != lengths:
            raise CaptureError(f"hooks file {path} has row lengths {data['lengths'].tolist()}, expected {lengths}")
        return {i: data[f"layer_{i}"] for i in self.layer_ids}  # [sum_T, H]

    def capture_shard(
        self,
        llm: Any,
        prefix: str,
        batches: Iterator[list[list[int]]],
        index: list[IndexEntry],
        shard: dict[str, Any],
        on_batch: Callable[[int, list[list[int]]], None],
        window_tokens: int,
    ) -> dict[int, dict[str, Any]]:
        """A whole shard through the engine; TP rank 0 writes the layer files (sink.ShardSink).

        Rows are fed to the engine as a stream, at most `window_tokens` prompt tokens in flight, so
        the scheduler always has a full step and no batch boundary leaves the GPU idle.
        """
        from vllm import TokensPrompt

        tags = [f"{prefix}-{i}" for i in range(len(index))]
        shard = {**shard, "rows": [[t, e.offset, e.length] for t, e in zip(tags, index, strict=True)]}
        compat.rpc_result(llm.collective_rpc("e3p_open_shard", args=(shard,)), version=self.version)
        engine = llm.llm_engine
        in_flight = 0
        submitted = 0
        finished = False
        try:
            for b, batch in enumerate(batches):
                for ids in batch:
                    tag = tags[submitted]
                    engine.add_request(tag, TokensPrompt(prompt_token_ids=list(ids)), _sampling_params(tag))
                    submitted += 1
                    in_flight += len(ids)
                on_batch(b, batch)
                while in_flight > window_tokens:
                    in_flight -= self._step(engine)
            while engine.has_unfinished_requests():
                in_flight -= self._step(engine)
            if submitted != len(index):
                raise CaptureError(f"the shard has {len(index)} rows, {submitted} were read from its batches")
            reply = compat.rpc_result(llm.collective_rpc("e3p_finish_shard"), version=self.version)
            finished = True
        finally:
            if not finished:  # interrupted or failed: drop the requests and the worker's temp files
                with contextlib.suppress(Exception):
                    engine.abort_request(tags[:submitted])
                with contextlib.suppress(Exception):
                    llm.collective_rpc("e3p_abort_shard")
        if "error" in reply:
            message = f"the worker could not write the shard's layer files: {reply['error']}"
            if reply.get("user_error"):  # e.g. the disk filled up: one line for the user, no traceback
                raise WorkerUserError(message)
            raise CaptureError(message)
        self.stats = reply.get("stats", {})
        return {int(k): v for k, v in reply["entries"].items()}

    @staticmethod
    def _step(engine: Any) -> int:
        """One engine step; the prompt tokens of the requests it finished."""
        done = 0
        for out in engine.step():
            if out.finished:
                done += len(out.prompt_token_ids or ())
        return done


class VLLMBackend(CaptureBackend):
    """Capture with vLLM. Options are config `extract:` keys (schema.yaml); spec.extra may carry
    `output_dir`, the shard folder, under which the built-in path stages its files by default."""

    name = "vllm"

    def __init__(self, spec: CaptureSpec, options: dict[str, Any]):
        super().__init__(spec, options)
        self.llm: Any = None
        self.path: BuiltinPath | HooksPath | None = None
        self.info: dict[str, Any] = {}
        self._gpus: Any = None
        self._staging: Path | None = None
        self._run = uuid.uuid4().hex[:8]  # keeps tags unique if two jobs share a staging folder
        self._batches = itertools.count()
        self._workarounds = compat.Workarounds()
        self._children = ChildOutput()

    # ---- probe -------------------------------------------------------------------------------
    def probe(self) -> dict[str, Any]:
        try:
            return self._probe()
        except BaseException:
            self.close()  # free the engine, the GPU locks and the staging folder
            raise

    def _probe(self) -> dict[str, Any]:
        t0 = time.time()
        # vLLM forks its GPU workers unless this process has initialized CUDA (then it spawns them).
        # Forked workers start ~20 s sooner on the H200 (spawned ones import torch and vLLM again;
        # docs/performance.md). torch.cuda.is_available()/device_count() initialize the CUDA driver
        # without torch noticing, and a forked worker then dies with "CUDA error: initialization
        # error": make them ask NVML instead, wherever they are called in this process.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        version = compat.installed_version()
        model = self._model_facts()
        check_layer_ids(self.spec.layer_ids, model["num_hidden_layers"])
        self._gpus = self._claim_gpus()  # before vLLM is imported: it reads CUDA_VISIBLE_DEVICES
        on_cpu = self._on_cpu()
        self._workarounds = compat.engine_workarounds(
            version, on_cpu, model["architectures"], disabled=compat.workarounds_disabled()
        )
        if self._workarounds.refusal:
            raise EngineError(self._workarounds.refusal)
        for line in self._workarounds.log_lines:
            log(line)
        self._staging = self._make_staging()

        candidates, fallback_reason = self._candidate_paths(version, model)
        arch = model["architectures"][0] if model["architectures"] else "the model"
        wanted = self.options.get("capture_path", "auto")
        for k, name in enumerate(candidates):
            last = k == len(candidates) - 1
            try:
                t_start = time.time()
                self._start(name, version, on_cpu)
                t_smoke = time.time()
                self._smoke(version, model)
                timings = {"engine_init_s": round(t_smoke - t_start, 2), "smoke_s": round(time.time() - t_smoke, 2)}
                break
            except Exception as e:  # auto: fall back to the hooks path; else one line with the root cause
                self._shutdown_engine()
                err = (
                    EngineError(str(e))  # the smoke capture's message names the version and the fix
                    if isinstance(e, CaptureError)
                    else engine_error(e, self._children.text(), version=version, arch=arch, path=name, wanted=wanted)
                )
                if last:
                    raise err from e
                fallback_reason = f"{name} path failed its probe: {err}"[:500]
                log(f"the {name} capture path failed its probe ({err}); trying {candidates[k + 1]}")

        n = model["num_hidden_layers"]
        self.info = {
            "engine": "vllm",
            "engine_version": version,
            "capture_path": self.path.name,
            "tp_size": self.spec.tp_size,
            "final_layer_reachable": self.path.name == "hooks"
            or compat.builtin_final_layer_reachable(version, model["architectures"]),
            "final_layer_captured": n in self.spec.layer_ids,
            "num_hidden_layers": n,
            "hidden_size": model["hidden_size"],
            "dtype": self.spec.dtype,
            "architectures": model["architectures"],
            "platform": "cpu" if on_cpu else "cuda",
            "gpu_ids": os.environ.get("CUDA_VISIBLE_DEVICES") if not on_cpu else None,
            "staging_dir": str(self._staging),
            "fallback_reason": fallback_reason,
            "workarounds": self._workarounds.names,
            "probe_s": round(time.time() - t0, 2),
            **timings,
        }
        return self.info

    def _model_facts(self) -> dict[str, Any]:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(self.spec.model_path, trust_remote_code=self.spec.trust_remote_code)
        text = cfg.get_text_config()  # the language model of a VLM (Kimi-K2.5)
        return {
            "num_hidden_layers": int(text.num_hidden_layers),
            "hidden_size": int(text.hidden_size),
            "vocab_size": int(text.vocab_size),
            "architectures": list(getattr(cfg, "architectures", None) or []),
        }

    def _claim_gpus(self) -> Any:
        from ..gpus import claim_gpus, count_gpus

        if "CUDA_VISIBLE_DEVICES" not in os.environ and count_gpus() == 0:
            return None  # no NVIDIA GPU here (vLLM's CPU build): nothing to claim
        return claim_gpus(self.spec.tp_size)

    @staticmethod
    def _on_cpu() -> bool:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()

    def _make_staging(self) -> Path:
        """extract.staging_dir, else <output_dir>/.vllm-staging (same filesystem), else a temp folder."""
        configured = self.options.get("staging_dir") or None
        out_dir = self.spec.extra.get("output_dir") or self.options.get("output_dir")
        if configured:
            path = Path(configured) / f"eagle3prep-{self._run}"
        elif out_dir:
            path = Path(out_dir) / ".vllm-staging"
            shutil.rmtree(path, ignore_errors=True)  # left by a killed run of this shard
        else:
            return Path(tempfile.mkdtemp(prefix="eagle3prep-vllm-"))
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _candidate_paths(self, version: str, model: dict[str, Any]) -> tuple[list[str], str | None]:
        """The capture paths to try in order, and why the built-in one was left out (if it was)."""
        wanted = self.options.get("capture_path", "auto")
        if wanted not in ("auto", "builtin", "hooks"):
            raise ConfigError(f"extract.capture_path = {wanted!r} is not one of ['auto', 'builtin', 'hooks']")
        if wanted == "hooks":
            return ["hooks"], None
        blocker = compat.builtin_blocker(
            version, model["architectures"], self.spec.layer_ids, model["num_hidden_layers"]
        )
        if wanted == "builtin":
            if blocker:
                raise ConfigError(
                    f"extract.capture_path = builtin cannot capture layer ids {self.spec.layer_ids}: {blocker}; "
                    "set extract.capture_path: hooks (or auto)"
                )
            return ["builtin"], None
        if blocker:
            log(f"the built-in path is no fallback here: {blocker}")
            return ["hooks"], blocker
        if compat.uses_deepseek_backbone(model["architectures"]):
            # MoE on the DeepSeek backbone (Kimi, GLM-5): the hooks path has not been checked on the
            # GPU there (expert/data parallel layouts); vLLM's own path is the one its authors test.
            return ["builtin", "hooks"], None
        # hooks first: only it writes the layer files from the worker (pinned slots, no per-request
        # files; docs/performance.md); the built-in path is the fallback where the hooks fail their probe.
        return ["hooks", "builtin"], None

    def _engine_kwargs(self, path: BuiltinPath | HooksPath) -> dict[str, Any]:
        opt = self.options
        kwargs: dict[str, Any] = {
            "model": self.spec.model_path,
            "skip_tokenizer_init": True,  # we hand over token ids; the engine needs no tokenizer
            "dtype": self.spec.dtype,
            "tensor_parallel_size": self.spec.tp_size,
            # +1: the one sampled token must fit after a prompt of max_seq_len tokens.
            "max_model_len": self.spec.max_seq_len + 1,
            "max_num_batched_tokens": opt.get("max_num_batched_tokens"),
            "gpu_memory_utilization": opt.get("gpu_memory_utilization", 0.9),
            "enforce_eager": bool(opt.get("enforce_eager", False)),
            "quantization": opt.get("quantization"),
            # A prefix-cache hit skips the forward of the cached tokens: their rows would be missing.
            "enable_prefix_caching": False,
            "trust_remote_code": self.spec.trust_remote_code,
            "seed": 0,
        }
        kwargs.update(path.engine_kwargs())
        kwargs.update(opt.get("engine_args") or {})  # the user's word wins, as documented...
        kwargs.update(path.engine_kwargs())  # ...except where a capture path needs its setting (hooks: eager)
        kwargs = compat.merge_engine_kwargs(kwargs, self._workarounds.engine_kwargs)  # known engine bugs
        if kwargs.get("enable_prefix_caching"):
            raise ValueError(
                "extract.engine_args.enable_prefix_caching must stay false: cached tokens are not captured"
            )
        return {k: v for k, v in kwargs.items() if v is not None}

    def _start(self, name: str, version: str, on_cpu: bool) -> None:
        from vllm import LLM

        self._children = ChildOutput()  # the engine's processes print the root cause of a failed start
        if name == "builtin":
            self.path = BuiltinPath(self.spec.layer_ids, self._staging, version, on_cpu)
        else:
            # The hooks read the V1 model runner's input batch (vllm_compat.step_layout).
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
            self.path = HooksPath(self.spec.layer_ids, self._staging, version)
        kwargs = self._engine_kwargs(self.path)
        log(f"starting vLLM {version} ({name} path): {kwargs}")
        with self._children.routed():
            self.llm = LLM(**kwargs)
        self.path.install(self.llm)

    def _smoke(self, version: str, model: dict[str, Any]) -> None:
        """One short prompt at the real TP size: every requested layer back, shaped [T, H]."""
        prompt = [(7 + 3 * i) % model["vocab_size"] for i in range(SMOKE_TOKENS)]
        try:
            out = self.capture([prompt])
        except CaptureError as e:
            raise CaptureError(f"smoke capture failed on vLLM {version}: {e}; {self._hint(version, model)}") from e
        want = {i: (SMOKE_TOKENS, model["hidden_size"]) for i in self.spec.layer_ids}
        got = {i: tuple(t.shape) for i, t in out.items()}
        if got != want:
            raise CaptureError(
                f"smoke capture on vLLM {version} ({self.path.name} path) returned layers {got}, "
                f"expected {want}; {self._hint(version, model)}"
            )
        bad = [i for i, t in out.items() if not bool(t.float().isfinite().all())]
        if bad:
            raise CaptureError(f"smoke capture on vLLM {version} returned non-finite values in layers {bad}")

    def _hint(self, version: str, model: dict[str, Any]) -> str:
        if self.path is not None and self.path.name == "builtin":
            return compat.builtin_fix_hint(version, model["architectures"])
        return "report this model and vLLM version; the hf backend (extract.backend: hf) is the fallback"

    # ---- capture -----------------------------------------------------------------------------
    def capture(self, batch: list[list[int]]) -> dict[int, torch.Tensor]:
        if self.llm is None:
            raise RuntimeError("VLLMBackend.capture() before probe(): call probe() first")
        b = next(self._batches)
        tags = [f"e3p-{self._run}-{b}-{i}" for i in range(len(batch))]
        return self.path.capture(self.llm, batch, tags)  # {layer_id: [sum_T, H]} in batch order

    def writes_layer_files(self) -> bool:
        return isinstance(self.path, HooksPath)

    def capture_shard(
        self,
        batches: Iterator[list[list[int]]],
        index: list[IndexEntry],
        layer_paths: dict[int, str],
        on_batch: Callable[[int, list[list[int]]], None],
    ) -> dict[int, dict[str, Any]]:
        if self.llm is None or not self.writes_layer_files():
            raise RuntimeError("capture_shard() needs a probed engine on the hooks path")
        step_tokens = self._step_tokens()
        shard = {
            "layer_paths": {str(k): v for k, v in layer_paths.items()},
            "hidden_size": self.info["hidden_size"],
            "dtype": self.spec.dtype,
            "total_tokens": sum(e.length for e in index),
            "step_tokens": step_tokens,
            "slots": HOST_SLOTS,
        }
        window = max(int(self.options.get("batch_tokens") or 0), 2 * step_tokens)
        prefix = f"e3p-{self._run}-{next(self._batches)}"
        entries = self.path.capture_shard(self.llm, prefix, batches, index, shard, on_batch, window)
        self.capture_stats = {"window_tokens": window, **self.path.stats}
        return entries

    def _step_tokens(self) -> int:
        """The scheduler's token budget per forward step (the largest step the worker will see)."""
        config = getattr(self.llm.llm_engine, "vllm_config", None)
        budget = getattr(getattr(config, "scheduler_config", None), "max_num_batched_tokens", None)
        return int(budget or self.options.get("max_num_batched_tokens") or 8192)

    # ---- close -------------------------------------------------------------------------------
    def _shutdown_engine(self) -> None:
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            import gc

            gc.collect()

    def close(self) -> None:
        self._shutdown_engine()
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        if self._gpus is not None:
            self._gpus.release()
            self._gpus = None
