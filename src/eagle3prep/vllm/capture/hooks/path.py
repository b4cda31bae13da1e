"""The hooks path, driver side: forward hooks in the worker extension (worker.HiddenStatesCapture); TP rank 0's
worker writes the layer files, and holds every row of a request once it ended."""

from __future__ import annotations

import os
from typing import Any

from ... import registry
from .. import message
from ..feed import log
from ..loop import WorkerSinkPath
from .worker import HiddenStatesCapture

WORKER_EXTENSION = f"{HiddenStatesCapture.__module__}.{HiddenStatesCapture.__qualname__}"


class HooksPath(WorkerSinkPath):
    """Forward hooks in the worker extension; TP rank 0's worker writes the layer files."""

    name = "hooks"

    def prepare_environment(self) -> None:
        # The hooks read the V1 model runner's input batch (internals.step_layout); vLLM 0.33 defaults to the V2 one.
        os.environ.setdefault(registry.entry("VLLM_USE_V2_MODEL_RUNNER").path, "0")

    def engine_kwargs(self) -> dict[str, Any]:
        # Hooks need eager mode: compiled graphs (torch.compile, CUDA graphs) bypass module hooks.
        return {"worker_extension_cls": WORKER_EXTENSION, "enforce_eager": True}

    def install(self, llm: Any) -> None:
        reply = message.call(llm, "e3p_install_hooks", self.layer_ids, version=self.version)
        log(f"hooks installed on rank 0: {reply.to_wire()}")
