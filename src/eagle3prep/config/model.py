"""Config values against the model folder: layers.ids resolved against its depth, tokenize.max_seq_len against
its context."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..drafts import capture_layer_ids
from ..errors import ConfigError
from ..model_facts import ModelFacts

# Positions vLLM needs after a row of tokenize.max_seq_len tokens: the one token it samples (its max_model_len is
# max_seq_len + this: vllm/capture/engine_args.py).
VLLM_SAMPLED_TOKENS = 1


def model_layer_ids(
    model_path: str, ids: Sequence[int] | None, convention: str, drafts: Sequence[Mapping[str, Any]] = ()
) -> list[int]:
    """layers.ids in `convention`, extended by the drafts' layers, resolved against the model's N, or a one-line
    ConfigError."""
    n = ModelFacts.read(model_path).num_hidden_layers
    try:
        return capture_layer_ids(ids, convention, drafts, n)
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None


def model_max_positions(model_path: str | Path) -> int | None:
    """Longest row the model takes (ModelFacts.max_positions); None for a tokenizer-only folder."""
    if not (Path(model_path) / "config.json").is_file():
        return None
    return ModelFacts.read(model_path).max_positions


def check_max_seq_len(max_seq_len: int, model_path: str | Path, engine: str | None = None) -> None:
    """Raise ConfigError when tokenize.max_seq_len is longer than the model can take; an `engine` of "vllm" needs
    VLLM_SAMPLED_TOKENS positions more."""
    limit = model_max_positions(model_path)
    room = VLLM_SAMPLED_TOKENS if engine == "vllm" else 0
    if limit is None or max_seq_len + room <= limit:
        return
    where = f"max_position_embeddings in {Path(model_path) / 'config.json'}"
    if max_seq_len > limit:
        raise ConfigError(
            f"config error: tokenize.max_seq_len = {max_seq_len} is above the model's context of {limit} tokens "
            f"({where}); set it to {limit - room} or less"
        )
    raise ConfigError(
        f"config error: tokenize.max_seq_len = {max_seq_len} fills the model's context of {limit} tokens ({where}), "
        f"and extract.backend vllm samples one token after each row; set it to {limit - room} or less"
    )
