"""The backend of a shard without rows (more shards than rows): the same files, shape [0, H], no engine.

Starting vLLM or transformers for zero rows costs minutes of a GPU job and proves nothing; the shard's
shape comes from the model's config.json, which the extract job has read already.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..model_facts import require_hidden_size
from ..shard.sink import LayerSink, SinkPlan
from .base import CaptureBackend, CaptureSpec, EngineInfo

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ..shard.sink import SinkSpec

CAPTURE_PATH = "none (no rows)"


class EmptyShardBackend(CaptureBackend):
    name = "empty"

    def __init__(self, spec: CaptureSpec, engine_version: str):
        super().__init__(spec)
        self.engine_version = engine_version  # the engine the neighbouring shards name

    def probe(self) -> EngineInfo:
        facts = self.spec.model_facts()
        return EngineInfo(
            engine="transformers" if self.spec.backend == "hf" else self.spec.backend,
            engine_version=self.engine_version,
            capture_path=CAPTURE_PATH,
            tp_size=self.spec.tp_size if self.spec.backend == "vllm" else 1,
            dtype=self.spec.dtype,
            num_hidden_layers=facts.num_hidden_layers,
            hidden_size=require_hidden_size(facts, self.spec.model_path),
            final_layer_reachable=True,  # nothing was captured: no layer was out of reach
            details={"engine_started": False},
        )

    def sink_plan(self) -> SinkPlan:
        return SinkPlan(step_tokens=1, slots=1, tag_prefix="row")  # no step ever reaches the sink

    def capture_shard(self, batches: Iterator[list[list[int]]], sink: SinkSpec) -> dict[int, dict[str, Any]]:
        if next(batches, None) is not None:
            raise RuntimeError("EmptyShardBackend was given rows; it only writes shards without rows")
        out = LayerSink(sink)
        try:
            return out.finish()
        except BaseException:
            out.abort()
            raise
