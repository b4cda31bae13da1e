"""The capture-backend interface (DESIGN.md §5): probe(), capture_shard(batches, sink), close().

Every backend writes through the same LayerSink (shard/sink.py), in whichever process holds the
rows; the smoke capture of probe() writes a throw-away shard the same way.
"""

from __future__ import annotations

import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3prep.config import schema_default

from ..model_facts import ModelFacts
from ..shard.formats import StorageFormat, storage_format

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

    from ..settings import ExtractSettings
    from ..shard.sink import SinkPlan, SinkSpec


@dataclass(slots=True)
class EngineInfo:
    """What a backend's probe found: the manifest records all but the shape and the volatile timings."""

    engine: str
    engine_version: str
    capture_path: str
    tp_size: int
    dtype: str
    num_hidden_layers: int
    hidden_size: int
    final_layer_reachable: bool
    details: dict[str, Any] = field(default_factory=dict)  # engine-specific facts for the manifest
    volatile: dict[str, Any] = field(default_factory=dict)  # differ between runs (timings, GPU ids): timings.json

    def manifest_entry(self) -> dict[str, Any]:
        keys = ("engine", "engine_version", "capture_path", "tp_size", "final_layer_reachable", "dtype")
        return {**{k: getattr(self, k) for k in keys}, **self.details}


@dataclass(frozen=True, slots=True)
class CaptureSpec:
    """One capture, the one object every backend receives: the typed `extract:` settings and what they are applied
    to (the model and its config.json facts, its layer ids, the longest row). The engine, dtype, device and TP size
    are the settings'; the storage format is the one extract.storage names, resolved once here for every writer of
    the job."""

    settings: ExtractSettings
    model_path: str
    layer_ids: list[int]  # our convention (layers.py), ascending; N = pre-norm final state
    max_seq_len: int
    trust_remote_code: bool = schema_default("model", "trust_remote_code")
    facts: ModelFacts | None = None  # the model's, when the job has read them (model_facts() reads them otherwise)
    storage: StorageFormat = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage", storage_format(self.settings.content.storage))  # frozen: set once

    def model_facts(self) -> ModelFacts:
        """The model's config.json facts: those the spec carries, or read now."""
        return self.facts or ModelFacts.read(self.model_path)

    def with_facts(self) -> CaptureSpec:
        """This spec carrying the model's facts, so that no backend reads config.json again."""
        return self if self.facts is not None else replace(self, facts=ModelFacts.read(self.model_path))

    @property
    def backend(self) -> str:  # "hf" | "vllm"
        return self.settings.content.backend

    @property
    def dtype(self) -> str:  # "bfloat16" | "float16" | "float32"
        return self.settings.content.dtype

    @property
    def device(self) -> str:  # hf backend: "cpu" | "cuda"
        return self.settings.content.device

    @property
    def tp_size(self) -> int:
        return self.settings.content.tp_size

    def gpus(self) -> int:
        """GPUs a job of this spec holds: tp_size for vllm, one for hf on cuda (validate uses the same)."""
        if self.backend == "vllm":
            return self.tp_size
        return 1 if self.device.startswith("cuda") else 0


class CaptureBackend(ABC):
    """Runs the target model over token rows and writes the hidden states at `spec.layer_ids`."""

    name: str = "base"

    def __init__(self, spec: CaptureSpec):
        self.spec = spec
        self.capture_stats: dict[str, Any] = {}  # timings of the last capture_shard(), for timings.json
        # {shard row: [T-1] float32} prompt logprobs of the actual tokens, for SinkSpec.logprob_rows
        self.capture_logprobs: dict[int, Any] = {}

    @property
    def settings(self) -> ExtractSettings:
        return self.spec.settings

    @abstractmethod
    def probe(self) -> EngineInfo:
        """Load the engine, check it can capture every requested id (a smoke shard), describe itself."""

    @abstractmethod
    def capture_shard(self, batches: Iterator[list[list[int]]], sink: SinkSpec) -> dict[int, dict[str, Any]]:
        """Forward every row of `batches` (the shard's rows in order; row i is `sink.tag(i)`) and write
        its layers through a LayerSink(sink); return LayerSink.finish()'s {layer_id: file entry}. The
        prompt logprobs of `sink.logprob_rows` go to `capture_logprobs`."""

    @abstractmethod
    def sink_plan(self) -> SinkPlan:
        """After probe(): the largest forward step (the host slots' size), the slots and the request tag prefix
        of the next capture, from which the job builds the shard's SinkSpec once."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine (GPU memory, worker processes)."""

    def __enter__(self) -> CaptureBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def smoke_shard(backend: CaptureBackend, prompt: list[int], hidden_size: int) -> dict[int, torch.Tensor]:
    """Capture one row into a throw-away shard through capture_shard() and read it back:
    {layer_id: [T, H]}, checked for every requested layer, the shape and finite values. The smoke
    shard is stored as the real ones will be (extract.storage), so FP8 quantization is probed too."""
    from ..shard.layout import layer_file
    from ..shard.readers import read_layer
    from ..shard.sink import SinkSpec

    ids = backend.spec.layer_ids
    plan = backend.sink_plan()
    with tempfile.TemporaryDirectory(prefix="eagle3prep-smoke-") as tmp:
        spec = SinkSpec(
            layer_paths={lid: str(Path(tmp) / layer_file(lid)) for lid in ids},
            hidden_size=hidden_size,
            dtype=backend.spec.dtype,
            rows=[(0, len(prompt))],
            step_tokens=max(len(prompt), 16),
            slots=plan.slots,
            tag_prefix=plan.tag_prefix,
            storage=backend.spec.storage,
        )
        backend.capture_shard(iter([[prompt]]), spec)
        out = {lid: read_layer(spec.layer_paths[lid]) for lid in ids}
    bad = [i for i, t in out.items() if not bool(t.float().isfinite().all())]
    if bad:
        raise RuntimeError(f"smoke capture returned non-finite values in layers {bad}")
    return out
