"""The generation engine of the regenerate stage: vLLM started and stopped the way the extract backend does it
(vllm/engine: the children's output kept for the root cause, one `error:` line on a failed start, the known
engine bugs' workarounds, the shutdown), fed token-id prompts with LLMEngine.add_request and stepped with
LLMEngine.step, the calls the extract backend's hooks path uses from vLLM 0.16 to 0.32."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from eagle3prep.model_facts import ModelFacts
from eagle3prep.regenerate.runner import Finished, RequestRejected
from eagle3prep.settings import RegenerateSettings, Sampling
from eagle3prep.tokenize.vision import EXPANDS
from eagle3prep.vllm import registry
from eagle3prep.vllm.engine.errors import ChildOutput, EngineError, died_fix_hint, engine_died, engine_error
from eagle3prep.vllm.engine.launch import (
    prefer_forked_workers,
    resolve_workarounds,
    runs_on_cpu,
    shutdown_engine,
    start_llm,
)
from eagle3prep.vllm.engine.watch import EngineGone, EngineWatch
from eagle3prep.vllm.engine.workarounds import merge_engine_kwargs

from ..infra.log import get_logger

log = get_logger("regenerate").info


def _request_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses: VLLMClientError (VLLMValidationError: a prompt longer than
    max_model_len, ...), which is no ValueError in recent releases; ValueError in older ones."""
    client_error = registry.load_optional("VLLMClientError")
    return (ValueError, TypeError) if client_error is None else (ValueError, TypeError, client_error)


class VLLMEngine:
    """vLLM as the runner's Engine, as the regenerate settings ask for it; start() starts it.

    Args:
        model_path: the target's folder.
        settings: regenerate.* (content: dtype, tp_size, enforce_eager, quantization, engine_args; speed: vLLM's
            memory and batch knobs). Its sampling is not read here: the gate serves greedily whatever the run's.
        sampling: temperature, top_p, top_k, max_tokens; each request adds its conversation's seed.
        stop_ids: tokens that end a reply (the engine has no tokenizer to find them itself).
        max_model_len: prompt + reply tokens per request.
    """

    def __init__(self, model_path: str, settings: RegenerateSettings, sampling: Sampling, stop_ids: list[int],
                 max_model_len: int, trust_remote_code: bool):  # fmt: skip
        self.model_path, self.settings, self.sampling = model_path, settings, sampling
        self.stop_ids, self.max_model_len, self.trust_remote_code = list(stop_ids), max_model_len, trust_remote_code
        self.llm: Any = None
        self.vision = False  # a target the stage feeds images to (start() reads it from config.json)
        self._with_images: set[str] = set()  # requests added with images, until they finish
        self.info: dict[str, Any] = {}
        self.volatile: dict[str, Any] = {}  # facts of this run only (timings.json, not the manifest)
        self._children = ChildOutput()
        self._watch: EngineWatch | None = None  # the engine core process, watched while a step waits on it

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def engine_kwargs(self, workarounds: dict[str, Any]) -> dict[str, Any]:
        c, s = self.settings.content, self.settings.speed
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            # Prompts arrive as token ids and replies are decoded by the job; a target fed images keeps its
            # tokenizer: vLLM builds its multimodal processor with it (as the extract backend does).
            "skip_tokenizer_init": not self.vision,
            "dtype": c.dtype,
            "tensor_parallel_size": c.tp_size,
            "max_model_len": self.max_model_len,
            "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "gpu_memory_utilization": s.gpu_memory_utilization,
            "enforce_eager": c.enforce_eager,
            "quantization": c.quantization,
            "trust_remote_code": self.trust_remote_code,
            "seed": 0,
        }
        kwargs.update(c.engine_args)
        kwargs = merge_engine_kwargs(kwargs, workarounds)  # known engine bugs: their fix wins
        return {k: v for k, v in kwargs.items() if v is not None}

    def start(self) -> dict[str, Any]:
        """Start vLLM; return what the manifest records of it. A failed start is one EngineError line."""
        t0 = time.time()
        prefer_forked_workers()
        version = registry.installed_version()
        facts = ModelFacts.read(self.model_path)
        self.vision = facts.vision_model_type in EXPANDS
        on_cpu = runs_on_cpu()
        fixes = resolve_workarounds(version, on_cpu, facts.architectures, self.settings.content.dtype, log)
        kwargs = self.engine_kwargs(fixes.engine_kwargs)
        log(f"starting vLLM {version}: {kwargs}")
        self._children = ChildOutput()
        arch = facts.architecture or "the model"
        try:
            self.llm = start_llm(kwargs, self._children, log)
        except Exception as e:
            self.close()
            raise engine_error(
                e, self._children.text(), version=version, arch=arch, path="generate", doing="for generation",
                section="regenerate",
            ) from e  # fmt: skip
        self._watch = EngineWatch(lambda how: self._died(version, how)).start()
        self.info = {
            "engine": "vllm",
            "engine_version": version,
            "platform": "cpu" if on_cpu else "cuda",
            "tp_size": kwargs["tensor_parallel_size"],
            "dtype": kwargs["dtype"],
            "max_model_len": self.max_model_len,
            "enforce_eager": kwargs["enforce_eager"],
            "quantization": kwargs.get("quantization"),
            "engine_args": dict(self.settings.content.engine_args),
            "workarounds": fixes.names,
        }
        self.volatile = {
            "gpu_ids": None if on_cpu else os.environ.get("CUDA_VISIBLE_DEVICES"),
            "engine_start_s": round(time.time() - t0, 2),
        }
        return self.info

    def params(self, seed: int) -> Any:
        """One request's SamplingParams. Greedy requests get no seed: it would not change them."""
        s = self.sampling
        return registry.load("SamplingParams")(
            # One output per request, when it finishes, as LLM.generate asks for: the default streams a growing
            # copy of every request's tokens at every step, work in this process that grows with the reply.
            output_kind=registry.load("RequestOutputKind").FINAL_ONLY,
            temperature=s.temperature,
            top_p=s.top_p,
            **({"top_k": s.top_k} if s.top_k else {}),
            max_tokens=s.max_tokens,
            **({} if s.greedy else {"seed": seed}),
            stop_token_ids=self.stop_ids,
            detokenize=False,  # PromptRenderer.decode_batch makes the text (the engine may have no tokenizer)
        )

    def add(self, request_id: str, prompt_ids: list[int], seed: int, images: list | None = None) -> None:
        TokensPrompt = registry.load("TokensPrompt")  # noqa: N806 - a class

        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        if images:  # one placeholder an image in prompt_ids: vLLM's processor expands each
            prompt = TokensPrompt(prompt_token_ids=prompt_ids, multi_modal_data={"image": images})
            self._with_images.add(request_id)  # its expanded prompt goes back to the runner, which checks it
        try:
            self.llm.llm_engine.add_request(request_id, prompt, self.params(seed))
        except _request_errors() as e:
            raise RequestRejected(" ".join(str(e).split())) from None

    def step(self) -> list[Finished]:
        out = []
        try:
            with self._watch.armed() if self._watch else contextlib.nullcontext():
                outputs = self.llm.llm_engine.step()
        except EngineGone as e:  # its engine core process died without a word; vLLM's client would wait forever
            raise EngineError(self._died(self.info.get("engine_version", "?"), str(e))) from None
        except Exception as e:  # the engine died mid-run: its own exception, from its processes' output
            version = self.info.get("engine_version", "?")
            raise engine_died(
                e, self._children.text(), version=version, doing="generating replies", section="regenerate"
            ) from e
        for o in outputs:
            if o.finished:
                c = o.outputs[0]
                reason = str(c.finish_reason or "error")
                detail = "" if c.stop_reason is None else f"stop_reason {c.stop_reason}"
                ran = list(o.prompt_token_ids or ()) if o.request_id in self._with_images else None
                self._with_images.discard(o.request_id)
                out.append(Finished(o.request_id, list(c.token_ids), reason, detail, ran))
        return out

    def has_unfinished(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def abort(self, request_ids: list[str]) -> None:
        self._with_images.difference_update(request_ids)
        with contextlib.suppress(Exception):
            self.llm.llm_engine.abort_request(request_ids)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        shutdown_engine(self)

    @staticmethod
    def _died(version: str, how: str) -> str:
        return f"vLLM {version} died generating replies: {how}; {died_fix_hint(how, 'regenerate')}"
