"""What the vLLM engine cannot be given, refused at parse time: extract.engine_args that would capture missing or
partial rows, and an extract.capture_path the installed vLLM cannot take for the model's family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..model_facts import ModelFacts
from .schema import coerce_scalar


def check_extract_engine_args(engine_args: dict[str, Any], max_seq_len: int) -> None:
    """What extract.engine_args cannot set, refused at parse time: the vLLM engine would start, after the GPU
    job was queued, and capture missing or partial rows."""
    caching = engine_args.get("enable_prefix_caching")
    if coerce_scalar(caching, ["boolean"]) if isinstance(caching, str) else caching:
        raise ConfigError(
            "config error: extract.engine_args.enable_prefix_caching must stay false: a prefix-cache hit skips the "
            "forward of the cached tokens, whose hidden states would then be missing"
        )
    dp = engine_args.get("data_parallel_size", 1)
    if str(dp).strip() not in ("1", "None"):  # each data-parallel rank serves its own requests
        raise ConfigError(
            f"config error: extract.engine_args.data_parallel_size = {dp}: a job captures with one engine of "
            "tp_size GPUs; to use more GPUs run more jobs at once (snakemake --resources gpus=N)"
        )
    limit = engine_args.get("max_model_len")
    if limit is not None and str(limit).strip().isdigit() and int(limit) <= max_seq_len:
        raise ConfigError(
            f"config error: extract.engine_args.max_model_len = {limit} must exceed tokenize.max_seq_len = "
            f"{max_seq_len} (a row and the one token the engine generates); leave it unset, extract sets it"
        )


def check_capture_path(backend: str, capture_path: str, model_path: str | Path) -> None:
    """extract.capture_path against the installed vLLM and the model's family, at parse time: a family no path of
    this vLLM takes (no SupportsEagle3 for the built-in path, no hooks from 0.34 on) is refused before any GPU job,
    in one line naming what can capture it (vllm/families.py). Where no vLLM is installed here, or vLLM
    cannot tell, the engine start decides."""
    if backend != "vllm" or not (Path(model_path) / "config.json").is_file():
        return
    archs = ModelFacts.read(model_path).architectures
    if not archs:
        return
    from ..vllm import families

    asked = families.installed_support(archs[0])
    if asked is None:
        return
    version, supports = asked
    if line := families.refusal(version, archs[0], capture_path, supports):
        raise ConfigError(f"config error: {line}")
