"""vLLM capture backend (DESIGN.md §5): start the engine, pick a capture path, stream a shard.

probe() picks the path (extract.capture_path: auto | builtin | hooks; choice.py), starts the engine
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
from ...config import ConfigError
from ...errors import UserError
from ...layers import check_layer_ids
from ...model_facts import ModelFacts, require_hidden_size
from ...shard.sink import SinkPlan
from ...tokenize.vision import EXPANDS
from .. import families, memory, registry
from ..engine import workarounds
from ..engine.errors import ChildOutput, EngineError, engine_died, engine_error
from ..engine.launch import prefer_forked_workers, resolve_workarounds, shutdown_engine, start_llm
from . import choice
from .builtin.path import BuiltinPath
from .hooks.path import HooksPath
from .loop import log
from .requests import CaptureError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ...settings import ExtractSettings
    from ...shard.sink import SinkSpec

SMOKE_TOKENS = 16  # length of the smoke-capture prompt
# Pinned host slots of the hooks path, each one forward step of every requested layer (8B shape,
# 16k-token steps: 512 MiB): one being filled, up to two with the writer threads (docs/DESIGN.md §5).
HOST_SLOTS = 3


class VLLMBackend(CaptureBackend):
    """Capture with vLLM, as the typed `extract:` settings say. Both capture paths write the layer files from
    TP rank 0's worker; nothing is staged per request. `facts`: the model's, when the job has read them."""

    name = "vllm"

    def __init__(self, spec: CaptureSpec, settings: ExtractSettings, facts: ModelFacts | None = None):
        super().__init__(spec, settings)
        self.facts = facts
        self.llm: Any = None
        self.path: BuiltinPath | HooksPath | None = None
        self.info: EngineInfo | None = None
        self._run = uuid.uuid4().hex[:8]  # part of every request tag: unique for the engine's lifetime
        self._shards = itertools.count()
        self._workarounds = workarounds.Workarounds()
        self._children = ChildOutput()
        self.memory_note = ""  # how the GPU memory was planned (vllm/memory.py), for the manifest

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
        model = self.facts = self.facts or ModelFacts.read(self.spec.model_path)
        check_layer_ids(self.spec.layer_ids, model.num_hidden_layers)
        on_cpu = self._on_cpu()
        self._workarounds = resolve_workarounds(version, on_cpu, model.architectures, self.spec.dtype, log)
        arch = model.architectures[0] if model.architectures else ""
        supports = families.supports_eagle3(arch) if arch else None
        candidates, fallback_reason = self._candidate_paths(version, model, supports, on_cpu)
        timings, fallback_reason = self._start_first(candidates, version, model, on_cpu, fallback_reason)
        self.info = self._engine_info(version, model, on_cpu, fallback_reason)
        self.info.volatile.update(probe_s=round(time.time() - t0, 2), **timings)
        return self.info

    def _start_first(self, candidates: list[str], version: str, model: ModelFacts, on_cpu: bool,
                     fallback_reason: str | None) -> tuple[dict[str, float], str | None]:  # fmt: skip
        """Start the engine on the first capture path whose start and smoke capture pass: (their timings,
        why an earlier path was passed over, or the given reason when none was)."""
        arch = model.architectures[0] if model.architectures else "the model"
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
                                      builtin_fix=f"use {families.other_ways(version, arch)}")
                )  # fmt: skip
                if last or getattr(err, "any_path", False):
                    raise err from e
                fallback_reason = f"{name} path failed its probe: {err}"[:500]
                log(f"the {name} capture path failed its probe ({err}); trying {candidates[k + 1]}")
        raise AssertionError("no capture path to try")  # _candidate_paths names at least one

    def _engine_info(self, version: str, model: ModelFacts, on_cpu: bool, fallback_reason: str | None) -> EngineInfo:
        """What the running engine is, for the manifest; `volatile` gets the probe's timings after."""
        n = model.num_hidden_layers
        return EngineInfo(
            engine="vllm",
            engine_version=version,
            capture_path=self.path.name,
            tp_size=self.spec.tp_size,
            dtype=self.spec.dtype,
            num_hidden_layers=n,
            hidden_size=require_hidden_size(model, self.spec.model_path),
            final_layer_reachable=self.path.name == "hooks"
            or choice.builtin_final_layer_reachable(version, model.architectures),
            details={
                "final_layer_captured": n in self.spec.layer_ids,
                "architectures": model.architectures,
                "platform": "cpu" if on_cpu else "cuda",
                "fallback_reason": fallback_reason,
                "workarounds": self._workarounds.names,
                **({"memory": self.memory_note} if self.memory_note else {}),
            },
            volatile={"gpu_ids": os.environ.get("CUDA_VISIBLE_DEVICES") if not on_cpu else None},
        )

    @staticmethod
    def _on_cpu() -> bool:
        return registry.member(registry.load("current_platform"), "Platform.is_cpu")()

    def _candidate_paths(
        self, version: str, model: ModelFacts, supports_eagle3: bool | None = None, on_cpu: bool = False
    ) -> tuple[list[str], str | None]:
        """The capture paths to try in order, and why the built-in one was left out (if it was).
        `supports_eagle3`: whether this vLLM's model class has SupportsEagle3 (None: unknown)."""
        wanted = self.settings.content.capture_path  # the schema allows auto | builtin | hooks
        arch = model.architectures[0] if model.architectures else "the model"
        # A family no path of this vLLM takes, or hooks asked of a vLLM without them: the parse-time line, again
        # here for a job whose environment the parse could not see (vllm/families.py).
        if refusal := families.refusal(version, arch, wanted, supports_eagle3):
            raise ConfigError(refusal)
        # What the hooks read of vLLM's V1 model runner is gone from this vLLM (0.34 on): auto has the built-in path.
        hooks_gone = registry.blocked(registry.HOOKS, version)
        if wanted == "hooks":
            return ["hooks"], None
        blocker = choice.builtin_blocker(
            version, model.architectures, self.spec.layer_ids, model.num_hidden_layers, supports_eagle3
        )
        if hooks_gone and wanted == "auto":
            hooks_refusal = registry.missing_line(hooks_gone[0], version=version)
            if blocker:
                other = registry.missing_line(
                    hooks_gone[0], version=version, fix_text=f"use {families.other_ways(version, arch)}"
                )
                raise ConfigError(f"no capture path runs on vLLM {version} here: {blocker}; {other}")
            log(f"the hooks path is no choice here: {hooks_refusal}")
            return ["builtin"], hooks_refusal
        if wanted == "builtin":
            if blocker:
                raise ConfigError(
                    f"extract.capture_path = builtin cannot capture layer ids {self.spec.layer_ids}: {blocker}; "
                    f"use {families.other_ways(version, arch)}"
                )
            return ["builtin"], None
        if blocker:
            log(f"the built-in path is no fallback here: {blocker}")
            return ["hooks"], blocker
        if choice.builtin_first(version, on_cpu):
            # No GPU measurement of this vLLM: the nearest are 0.34's built-in path (0.94 / 0.93 of compiled
            # prefill; the matrix's cells validated) and 0.26's hooks (docs/guides/install.md).
            return ["builtin", "hooks"], None
        # Hooks first on every family: with vLLM 0.26 they beat the built-in path on the 8B shape and the DeepSeek-V3
        # MoE, with the same validation verdicts (docs/DESIGN.md §5, docs/evidence.md).
        return ["hooks", "builtin"], None

    def _engine_kwargs(self, path: BuiltinPath | HooksPath) -> dict[str, Any]:
        content, speed = self.settings.content, self.settings.speed
        kwargs: dict[str, Any] = {
            "model": self.spec.model_path,
            # We hand over token ids; the engine needs no tokenizer, except for a target we feed images to
            # (tokenize's EXPANDS): vLLM builds its multimodal processor with it. Kimi-K2.5 (a VLM wrapper
            # whose images are not fed yet) keeps skipping it: its tokenizer would need trust_remote_code.
            "skip_tokenizer_init": self.facts.vision_model_type not in EXPANDS,
            "dtype": self.spec.dtype,
            "tensor_parallel_size": self.spec.tp_size,
            # +1: the one sampled token must fit after a prompt of max_seq_len tokens.
            "max_model_len": self.spec.max_seq_len + 1,
            "max_num_batched_tokens": speed.max_num_batched_tokens,
            "gpu_memory_utilization": speed.gpu_memory_utilization,
            "enforce_eager": content.enforce_eager,
            "quantization": content.quantization,
            # A prefix-cache hit skips the forward of the cached tokens: their rows would be missing.
            "enable_prefix_caching": False,
            "trust_remote_code": self.spec.trust_remote_code,
            "seed": 0,
        }
        kwargs.update(path.engine_kwargs())
        kwargs.update(content.engine_args)  # the user's word wins, as documented...
        kwargs.update(path.engine_kwargs())  # ...except where a capture path needs its setting (hooks: eager)
        if self.facts.vision_model_type in EXPANDS:
            # Image rows' requests are made by several workers (images.RequestPool); vLLM's processor cache is
            # not made for that (its sender side mirrors the engine's cache in the order requests are made).
            kwargs["mm_processor_cache_gb"] = 0
        kwargs = workarounds.merge_engine_kwargs(kwargs, self._workarounds.engine_kwargs)  # known engine bugs
        if kwargs.get("enable_prefix_caching"):
            raise ValueError(
                "extract.engine_args.enable_prefix_caching must stay false: cached tokens are not captured"
            )
        if not self._on_cpu():
            kwargs["gpu_memory_utilization"] = self._memory_plan(kwargs).gpu_memory_utilization
        return {k: v for k, v in kwargs.items() if v is not None}

    def _memory_plan(self, kwargs: dict[str, Any]) -> memory.MemoryPlan:
        """Room outside vLLM's budget for the logits check's prompt logprobs and the hooks' step copies
        (vllm/memory.py), logged and kept for the manifest."""
        step = int(kwargs.get("max_num_batched_tokens") or self.settings.speed.max_num_batched_tokens)
        need = memory.hooks_peak_bytes(step, self.facts.hidden_size or 0, len(self.spec.layer_ids))
        if self.settings.content.logprob_rows:
            need += memory.logprob_peak_bytes(self.facts.vocab_size or 0, min(memory.LOGPROB_WINDOW, step))
        plan = memory.plan(float(kwargs["gpu_memory_utilization"]), memory.gpu_total_bytes(), need)
        log(f"memory: {plan.note}")
        self.memory_note = plan.note
        return plan

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
                f"smoke capture on vLLM {version} ({self.path.name} path) failed: {e}; {self._hint(version, model)}"
            ) from e

    def _hint(self, version: str, model: ModelFacts) -> str:
        if self.path is not None and self.path.name == "builtin":
            return choice.builtin_fix_hint(version, model.architectures)
        return "report this model and vLLM version; the hf backend (extract.backend: hf) is the fallback"

    # ---- capture -----------------------------------------------------------------------------
    def capture_shard(self, batches: Iterator[list[list[int]]], sink: SinkSpec) -> dict[int, dict[str, Any]]:
        if self.llm is None:
            raise RuntimeError("capture_shard() before probe(): call probe() first")
        # a full step always waiting, whatever the batches' size
        self.path.window_tokens = max(self.settings.speed.batch_tokens, 2 * sink.step_tokens)
        try:
            entries = self.path.capture_shard(self.llm, batches, sink)
        except (CaptureError, UserError):
            raise
        except Exception as e:  # the engine died mid-shard: its own exception, from its processes' output
            version = self.info.engine_version if self.info else registry.installed_version()
            raise engine_died(
                e, self._children.text(), version=version, doing=f"capturing ({self.path.name} path)"
            ) from e
        self.capture_stats, self.capture_logprobs = self.path.stats, self.path.logprobs
        return entries

    def sink_plan(self) -> SinkPlan:
        """The scheduler's token budget per forward step (the largest step the worker will see; engine_args may
        have changed it from extract.max_num_batched_tokens), and a tag prefix new to this engine: request ids
        must be unique for the engine's lifetime."""
        if self.llm is None:
            raise RuntimeError("sink_plan() before probe(): call probe() first")
        engine = registry.member(self.llm, "LLM.llm_engine")
        scheduler = registry.member(registry.member(engine, "LLMEngine.vllm_config"), "VllmConfig.scheduler_config")
        budget = registry.member(scheduler, "SchedulerConfig.max_num_batched_tokens")
        return SinkPlan(
            step_tokens=int(budget or self.settings.speed.max_num_batched_tokens),
            slots=HOST_SLOTS,
            tag_prefix=f"e3p-{self._run}-{next(self._shards)}",
        )

    # ---- close -------------------------------------------------------------------------------
    def close(self) -> None:
        shutdown_engine(self)
