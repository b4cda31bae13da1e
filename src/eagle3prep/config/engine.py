"""What the vLLM engine cannot be given, refused at parse time: extract.engine_args that would capture missing or
partial rows. (An extract.capture_path the installed vLLM cannot take for the model's family is refused by
vllm/families.check_capture_path, which asks that vLLM.)"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
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
