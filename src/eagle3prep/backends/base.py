"""The capture-backend interface (DESIGN.md §5): probe(), capture(batch), close()."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import torch

    from ..records import IndexEntry


@dataclass(slots=True)
class CaptureSpec:
    """What to capture and from which model; shared by every backend."""

    backend: str  # "hf" | "vllm"
    model_path: str
    layer_ids: list[int]  # our convention (layers.py), ascending; N = pre-norm final state
    dtype: str = "bfloat16"  # "bfloat16" | "float16" | "float32"
    device: str = "cpu"  # hf backend: "cpu" | "cuda"
    tp_size: int = 1
    max_seq_len: int = 2048
    trust_remote_code: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class CaptureBackend(ABC):
    """Runs the target model over token rows and returns the hidden states at `spec.layer_ids`."""

    name: str = "base"
    capture_stats: dict[str, Any] = {}  # noqa: RUF012 - timings of the last capture_shard(), for timings.json

    def __init__(self, spec: CaptureSpec, options: dict[str, Any]):
        self.spec = spec
        self.options = options

    @abstractmethod
    def probe(self) -> dict[str, Any]:
        """Load the engine, check it can capture every requested id, and describe itself.

        Returns at least: engine, engine_version, capture_path, tp_size, final_layer_reachable,
        num_hidden_layers, hidden_size, dtype. The result goes into the shard manifest.
        """

    @abstractmethod
    def capture(self, batch: list[list[int]]) -> dict[int, torch.Tensor]:
        """Forward a batch of rows; return {layer_id: [sum_T, H] CPU tensor in the model dtype}.

        Rows are concatenated in batch order, each row's tokens in order, so the caller can append
        the result straight to the shard's layer files.
        """

    def writes_layer_files(self) -> bool:
        """True when capture_shard() is available: the engine writes the layer files itself."""
        return False

    def capture_shard(
        self,
        batches: Iterator[list[list[int]]],
        index: list[IndexEntry],
        layer_paths: dict[int, str],
        on_batch: Callable[[int, list[list[int]]], None],
    ) -> dict[int, dict[str, Any]]:
        """Capture a whole shard into its layer files' temp files (see shard.ShardWriter.layer_paths).

        `batches` yields the shard's rows in `index` order; on_batch(b, batch) is called once each
        batch's rows are submitted (the caller writes their token ids). Returns {layer_id: entry} of
        the sealed temp files for ShardWriter.adopt_layers(). Only when writes_layer_files().
        """
        raise NotImplementedError(f"the {self.name} backend returns rows through capture(); it writes no files")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine (GPU memory, worker processes)."""
