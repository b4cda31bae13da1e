"""Validation of hidden-state shards (DESIGN.md §6), one module per family of checks: integrity.py (manifest,
files, index), content.py (token ids, layout, finite values, statistics), recompute.py (the full reference),
window.py and logits.py (the scalable checks, scalable.py, on slices.py's checkpoint slices). They judge by
the pass rule (passrule.py) against the independent forward (reference.py; routing.py: MoE router margins).
stage.py runs them and writes the report; every check's verdict is an eagle3prep.check.Check."""

from .stage import ValidateJobSettings, ValidatePaths, ValidationError, run_validate_job, validate_shard

__all__ = ["ValidateJobSettings", "ValidatePaths", "ValidationError", "run_validate_job", "validate_shard"]
