"""What the workflow needs to know about a model, read once from its config.json (DESIGN.md §4)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """Shape facts of the language model; a VLM wrapper's `text_config` (Kimi-K2.5) is read through."""

    num_hidden_layers: int
    hidden_size: int | None  # None only for configs that are not causal LMs (tests' minimal configs)
    vocab_size: int | None
    architectures: list[str]
    max_positions: int | None  # longest row: max_position_embeddings, times a rope factor that extends it
    model_type: str | None
    # A vision-language wrapper's own model_type (the config has a vision_config), e.g. "qwen2_5_vl"
    vision_model_type: str | None = None

    @property
    def architecture(self) -> str | None:
        """The model's class as its config names it first; messages say `facts.architecture or "the model"`."""
        return first_architecture(self.architectures)

    @classmethod
    def read(cls, model_path: str | os.PathLike) -> ModelFacts:
        path = Path(model_path) / "config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        text = config.get("text_config") or config
        if "num_hidden_layers" not in text:
            raise ValueError(f"{path} has no num_hidden_layers; is model.path a causal LM folder?")
        return cls(
            num_hidden_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]) if "hidden_size" in text else None,
            vocab_size=int(text["vocab_size"]) if "vocab_size" in text else None,
            architectures=list(config.get("architectures") or text.get("architectures") or []),
            max_positions=_max_positions(text),
            model_type=text.get("model_type") or config.get("model_type"),
            vision_model_type=config.get("model_type") if "vision_config" in config else None,
        )


def first_architecture(architectures: Sequence[str]) -> str | None:
    """The first of a config's `architectures` (the class vLLM and transformers load); None when it names none."""
    return architectures[0] if architectures else None


def require_hidden_size(facts: ModelFacts, model_path: str | os.PathLike) -> int:
    if facts.hidden_size is None:
        raise ValueError(f"{Path(model_path) / 'config.json'} has no hidden_size; is model.path a causal LM folder?")
    return facts.hidden_size


def _max_positions(text: dict) -> int | None:
    """max_position_embeddings, times the rope factor where the config extends the context that way
    (linear / dynamic / yarn, as vLLM derives max_model_len); None when unknown."""
    limit = text.get("max_position_embeddings")
    if not isinstance(limit, int):
        return None
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) in ("linear", "dynamic", "yarn") and rope.get("factor"):
        limit = int(rope.get("original_max_position_embeddings", limit) * rope["factor"])
    return limit
