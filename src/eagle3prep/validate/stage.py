"""The validate stage: is a hidden-state shard complete, intact, and the right numbers? (DESIGN.md §6)

The families of checks run in order, each only on what the previous ones passed: integrity (integrity.py),
content (content.py), then the sampled rows against the model, by the full reference (recompute.py) or by
slices of it (scalable.py). The tokenized shard is parsed once, and every layer file is read through one
LayerReader (subject.py).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from .. import paths
from ..check import Checks, failed_line
from ..config import reference_mode
from ..errors import UserError, same_command
from ..infra import faults
from ..infra.atomic import write_json
from ..infra.gpus import claim_job_gpus
from ..infra.log import get_logger
from ..shard.shardset import read_tokenized
from ..tokenize.row_inputs import RowImages
from .content import check_content
from .integrity import check_intact, check_manifest
from .passrule import STORAGE_FACTOR, miss_probability, rows_to_sample
from .recompute import check_reference
from .reference import ReferencePair
from .subject import ShardUnderTest

if TYPE_CHECKING:
    from ..settings import ValidateSettings

log = get_logger("validate")


class ValidationError(UserError, RuntimeError):
    """A shard failed a check; the message lists which, `failed` holds their names."""

    failed: list[str] = []  # noqa: RUF012 - set per instance when raised


@dataclass(frozen=True, slots=True)
class ValidatePaths:
    """The validate job's files: shard k's folder and tokenized rows in, its report out."""

    shard_dir: str  # results/hidden_states/shard_{k}
    tokenized_shard: str  # results/tokenized/shard_{k}.jsonl
    out_json: str  # results/validation/shard_{k}.json
    model_path: str


@dataclass(frozen=True, slots=True)
class ValidateJobSettings:
    """What every validate job reads: `validate:`, and heal.keep_failed, which decides what the next run does
    with a failed shard (the error says it)."""

    validate: ValidateSettings
    trust_remote_code: bool
    keep_failed: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        from ..settings import HealSettings, ValidateSettings

        keep_failed = HealSettings.from_config(config).keep_failed
        return cls(ValidateSettings.from_config(config), config["model"]["trust_remote_code"], keep_failed)


def run_validate_job(paths: ValidatePaths, settings: ValidateJobSettings) -> dict[str, Any]:
    """The validate stage's job: shard `shard_dir` checked against its tokenized rows and the model, by
    `settings`; the report written to `out_json`."""
    s, p = settings.validate, paths
    return validate_shard(
        p.shard_dir, p.tokenized_shard, p.out_json, p.model_path, s.sample_rows, s.seed, s.device, s.reference,
        settings.trust_remote_code, s.windows, keep_failed=settings.keep_failed,
    )  # fmt: skip


def validate_shard(
    shard_dir: str,
    tokenized_shard: str,
    out_json: str,
    model_path: str,
    sample_rows: int | str,
    seed: int,
    device: str,
    reference: bool | str,
    trust_remote_code: bool,
    windows: Sequence[Sequence[int]] | None,
    refs: ReferencePair | None = None,
    keep_failed: bool = False,
) -> dict[str, Any]:
    """Run every check, write the report to `out_json`, raise ValidationError if any failed.

    The arguments after `model_path` are validate.* (run_validate_job passes them from the settings) and
    model.trust_remote_code. `refs`: a ReferencePair already loaded (the validation matrix judges many shards
    of one model). `keep_failed`: heal.keep_failed (what the error says the next run does).
    """
    from ..healing.heal import files_seen

    checks = Checks()
    report: dict[str, Any] = {"shard_dir": str(shard_dir), "tokenized": str(tokenized_shard)}
    # Each file's size and mtime before a byte is read: a rerun that finds another one validates the shard again.
    report["files_seen"] = files_seen(shard_dir) if Path(shard_dir).is_dir() else {}
    m = check_manifest(shard_dir, checks)
    if m is not None:
        report.update(
            shard=m.shard, rows=m.rows, tokens=m.tokens, dtype=m.dtype, layer_ids=m.layer_ids, engine=m.engine
        )
        tokenized = read_tokenized(tokenized_shard, records=True)  # the one parse of the tokenized shard
        # Content checks only make sense on intact files (index.json's sha256 included); a corrupt shard stops here.
        subject = check_intact(Path(shard_dir), m, tokenized, checks)
        if subject is not None:
            report["layer_stats"] = check_content(subject, checks)
            report.update(
                _check_sampled_rows(
                    subject, checks, model_path, sample_rows, seed, device, reference, trust_remote_code, refs, windows
                )
            )
    _finish(report, checks, out_json, shard_dir, keep_failed)
    return report


def _check_sampled_rows(
    subject: ShardUnderTest,
    checks: Checks,
    model_path: str,
    sample_rows: int | str,
    seed: int,
    device: str,
    reference: bool | str,
    trust_remote_code: bool,
    refs: ReferencePair | None,
    windows: Sequence[Sequence[int]] | None,
) -> dict[str, Any]:
    """The sampled rows against the model (validate.reference): the report's entries this adds. Skipped when
    an earlier check failed: a wrong shard needs no recomputation to be refused."""
    mode, n = reference_mode(reference), len(subject.rows)
    picks = _sample(n, sample_rows, seed) if mode != "off" else []
    out: dict[str, Any] = {
        "reference_mode": mode,
        "reference_sample": {
            "rows": len(picks),
            "of": n,
            "miss_probability": miss_probability(n, len(picks)) if n else 0.0,
        },
    }
    if not picks or checks.failed:
        return out
    if mode == "scalable":
        from .scalable import validate_scalable

        out["scalable"] = validate_scalable(subject, model_path, picks, windows, checks)
        return out
    with claim_job_gpus(1 if device.startswith("cuda") and refs is None else 0):
        refs = refs or ReferencePair(model_path, subject.manifest.dtype, device, trust_remote_code)
        out["reference_floor"] = refs.describe()
        if subject.scaled:  # beside the floor run (the report reads reference_floor's words as they are)
            out["storage_floor"] = _storage_floor(subject)
        images = RowImages(model_path, subject.shard.tokenized)
        out["reference"], out["reference_layers"] = check_reference(subject, refs, picks, checks, images)
    return out


def _storage_floor(subject: ShardUnderTest) -> str:
    """A scaled storage's part of every bound, in words."""

    label = subject.scaled.label
    return (
        f"the {label} format's own floor: the reference stored as {label} and read back, {STORAGE_FACTOR:g}x its "
        "error added to each row's bound"
    )


def _sample(n_rows: int, sample_rows: int | str, seed: int) -> list[int]:
    """Row positions to recompute: `auto` = enough for passrule.MISS_RATE (all rows of a small shard)."""
    n = rows_to_sample(n_rows) if sample_rows == "auto" else min(int(sample_rows), n_rows)
    return sorted(random.Random(seed).sample(range(n_rows), n))


def _finish(report: dict[str, Any], checks: Checks, out_json: str, shard_dir: str, keep_failed: bool) -> None:
    """Write the report and print every check; a failed shard raises ValidationError, and its report goes to
    paths.failed_verdict(out_json) instead: it must not look like a pass, and it is the verdict the next run's
    healing reads."""
    report["checks"] = checks.to_json()
    report["ok"] = not checks.failed
    faults.kill_point("validate.before_report", shard=Path(shard_dir).name)
    failed_at = paths.failed_verdict(out_json)
    write_json(failed_at if checks.failed else out_json, report)
    for c in checks.items:
        log.info(f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
    if not checks.failed:
        Path(failed_at).unlink(missing_ok=True)  # an earlier failure of this shard is no verdict any more
        return
    error = ValidationError(f"{shard_dir}: {failed_line(checks.failed)}; {next_run(shard_dir, keep_failed)}")
    error.failed = [c.name for c in checks.failed]
    raise error


def next_run(shard_dir: str, keep_failed: bool) -> str:
    """What the next run of the same command does with a shard that failed validation (healing.heal decides it), in
    words: set aside and extracted again, or, kept in place (heal.keep_failed) or after too many redos, validated
    again, failing the run until it passes or is removed. Starts with "the next run" (healing.heal cuts there)."""
    from ..healing.heal import MAX_REDOS, failed_copies

    name = Path(shard_dir).name
    k = int(name.removeprefix("shard_")) if name.removeprefix("shard_").isdigit() else None
    redos = len(failed_copies(k)) if k is not None else 0
    if keep_failed or redos >= MAX_REDOS:
        why = "kept in place (heal.keep_failed)" if keep_failed else f"not extracted again after {redos} redos"
        return (
            f"the next run of the same command validates it again and fails, {why}, until it passes or you "
            f"remove {shard_dir} (then it is extracted again): {same_command()}"
        )
    return f"the next run of the same command moves it to results/failed/ and extracts it again: {same_command()}"
