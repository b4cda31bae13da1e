"""The extract stage: one tokenized shard in, one hidden-state shard folder out (DESIGN.md §4); stage.py holds it.

backend.py picks the capture backend a shard gets (backends/, vllm/capture/); the shard format is in shard/;
stage.py is the job around them.
"""

from eagle3prep.extract.stage import (
    ExtractJobSettings,
    ExtractPaths,
    extract_shard,
    free_space_probe,
    iter_batches,
    run_extract_job,
    shard_bytes,
)

__all__ = [
    "ExtractJobSettings",
    "ExtractPaths",
    "extract_shard",
    "free_space_probe",
    "iter_batches",
    "run_extract_job",
    "shard_bytes",
]
