"""Heal the results folder with the same command: find, when the workflow is parsed, every shard that is
missing, unfinished, changed after validation or that failed validation, and say in one line what is redone.

Snakemake alone does not redo them: a deleted shard whose validation and report exist is an intermediate
file it does not need, and a failed shard's folder still looks finished. The checks are directory listings,
`stat`s and existence tests; the files read are a validated shard's validation report (the size and mtime of each
file it saw: a file written in place leaves the folder's date alone) and the failed validation report of a shard
that failed (paths.validation_failure). What is found is redone through heal tickets (healing.tickets): the one
change on disk, moving a failed shard to results/failed/, is made by the heal job, before the shard's jobs.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..check import report_failures
from ..config import schema_default
from ..paths import EXPORT, FAILED, HIDDEN_STATES, MANIFEST, VALIDATION, VERIFIED, shard_dir, validation_json

# Outputs that are made from every validated shard: when one exists, a missing shard is not "not made yet".
DOWNSTREAM = (paths.DATASET_MANIFEST, EXPORT)
SNAKEMAKE_MARKER = ".snakemake_timestamp"  # shard.manifest.SNAKEMAKE_MARKER; allowed beside the listed files
SHARD_EXTRAS = frozenset({MANIFEST, "timings.json", SNAKEMAKE_MARKER})  # shard.manifest.SHARD_EXTRAS
MOVING, WOULD_MOVE = "moving it to", "would move it (not in a dry run) to"
MAX_REDOS = 2  # a shard that fails validation this many times is not extracted a third time
SHOWN = 10  # lines printed at parse time; the rest are counted


@dataclass(frozen=True, slots=True)
class Heal:
    """One shard (or the export, shard None) to redo (or to leave as it is), and why, in one line."""

    shard: int | None
    why: str
    force: str | None = None  # the output made again (its job gets a heal ticket); None: nothing is redone
    set_aside: bool = False  # move the shard folder to results/failed/ before the run starts

    def said(self, dryrun: bool = False) -> str:
        """`why`, or in a dry run what the run would do (a dry run moves nothing)."""
        return self.why.replace(MOVING, WOULD_MOVE) if dryrun and self.set_aside else self.why


def validate_log(k: int) -> str:
    return paths.log(f"validate/shard_{k}")


def _mtimes(folder: str, suffix: str = "") -> dict[str, int]:
    """{entry name: mtime_ns} of a folder's entries (one listing, one stat each); {} when it does not exist."""
    try:
        with os.scandir(folder) as entries:
            return {e.name: e.stat().st_mtime_ns for e in entries if e.name.endswith(suffix)}
    except FileNotFoundError:
        return {}


def validation_failure(k: int, since_ns: int) -> str | None:
    """Why shard k failed its last validation, from the report that validation kept (paths.validation_failure);
    None when it did not fail (no such report, one older than the shard, or a job that stopped before judging)."""
    path = paths.validation_failure(k)
    try:
        if os.stat(path).st_mtime_ns < since_ns:
            return None
        with open(path, encoding="utf-8") as f:
            failures = report_failures(json.load(f))
    except (OSError, ValueError):
        return None
    return f"{shard_dir(k)}: {failures}" if failures else None


def failed_copies(k: int) -> list[str]:
    """Earlier failed copies of shard k under results/failed/ (shard_k, shard_k.1, ...)."""
    names = set(_mtimes(FAILED))
    return [f"{FAILED}/{n}" for n in sorted(names) if n == f"shard_{k}" or n.startswith(f"shard_{k}.")]


def find(
    shards: Iterable[int], keep_failed: bool = schema_default("heal", "keep_failed"), dryrun: bool = False
) -> list[Heal]:
    """Every shard the same command should redo, with why (see the module docstring); `dryrun`: the lines say
    what a run would do (-n moves nothing)."""
    present = _mtimes(HIDDEN_STATES)
    validated = _mtimes(VALIDATION, ".json")
    if not present and not validated:
        return []  # a fresh folder: nothing to heal, no cost
    downstream = next((p for p in DOWNSTREAM if os.path.exists(p)), None)
    made_from: set[str] | None = None  # the shard folders `downstream` was made from, read when first needed
    damaged, export_damage = verified_damage()
    heals = []
    if export_damage and os.path.isdir(EXPORT):  # a removed export is made again as a missing output
        heals.append(Heal(None, f"{EXPORT}: {export_damage} ({VERIFIED}): exporting it again", EXPORT))
    for k in shards:
        folder, val = shard_dir(k), validation_json(k)
        val_ns = validated.get(f"shard_{k}.json")
        if f"shard_{k}" not in present:
            if val_ns is not None:
                heals.append(Heal(k, f"{folder} is missing but {val} exists: extracting it again", folder))
            elif downstream:
                if made_from is None:
                    made_from = shards_made_into(downstream)
                if made_from is not None and os.path.normpath(folder) not in made_from:
                    # More shards than the run that wrote `downstream` had (another num_shards or config):
                    # nothing was lost, the shard is new.
                    heals.append(Heal(k, f"{folder}: not extracted yet (not in {downstream})", folder))
                else:
                    heals.append(Heal(k, f"{folder} is missing but {downstream} exists: extracting it again", folder))
            continue
        try:
            manifest_ns = os.stat(f"{folder}/{MANIFEST}").st_mtime_ns
        except FileNotFoundError:
            heals.append(
                Heal(k, f"{folder} has no {MANIFEST} (a run stopped while writing it): extracting it again", folder)
            )
            continue
        if k in damaged:
            heals.append(Heal(k, f"{folder}: {damaged[k]} ({VERIFIED}): extracting it again", folder))
            continue
        if val_ns is not None:
            if present[f"shard_{k}"] > val_ns:  # a file was added, removed or renamed after validation
                # A listed file gone or an unlisted one there fails validation for certain: extract at once.
                if listing := listing_mismatch(folder):
                    heals.append(Heal(k, f"{folder}: {listing}: extracting it again", folder))
                else:
                    heals.append(Heal(k, f"{folder} changed after {val} was written: validating it again", val))
            elif changed := changed_in_place(folder, val):  # written in place: the folder's date does not move
                heals.append(Heal(k, f"{folder}: {changed} since {val} was written: validating it again", val))
            continue
        failure = validation_failure(k, manifest_ns)
        if failure:
            heals.append(_failed(k, failure, keep_failed, dryrun))
        elif downstream:
            heals.append(Heal(k, f"{val} is missing but {downstream} exists: validating {folder} again", val))
    return heals


def files_seen(folder: str | os.PathLike) -> dict[str, list[int]]:
    """{file: [size, mtime_ns]} of a shard folder's files (its Snakemake marker aside), as validation saw them: the
    record a rerun compares with (changed_in_place), one stat per file, no file read."""
    with os.scandir(folder) as entries:
        return {
            e.name: [st.st_size, st.st_mtime_ns]
            for e in entries
            if e.name != SNAKEMAKE_MARKER and e.is_file() and (st := e.stat())
        }


def changed_in_place(folder: str, val: str) -> str | None:
    """The first file of `folder` whose size or mtime differs from what its validation recorded (`files_seen`), in
    words; None when all agree or there is no record. Mtimes are compared to the second, so a copy that keeps only
    whole seconds (tar, some rsync targets) is not taken for a change; a file written again has a later second."""
    try:
        with open(val, encoding="utf-8") as f:
            seen = json.load(f).get("files_seen")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(seen, dict):
        return None
    for name, (size, mtime_ns) in sorted(seen.items()):
        try:
            st = os.stat(os.path.join(folder, name))
        except FileNotFoundError:
            return f"{name} is gone"
        if st.st_size != size:
            return f"{name} is {st.st_size} bytes, not the {size} validated"
        if st.st_mtime_ns // 10**9 != mtime_ns // 10**9:
            return f"{name} was written again (its mtime is not the one validated)"
    return None


def listing_mismatch(folder: str) -> str | None:
    """A file the shard's manifest lists that is not in the folder, or one there it does not list, in words;
    None when the listing matches or the manifest cannot tell (then validation judges the shard)."""
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            listed = json.load(f).get("files")
        with os.scandir(folder) as entries:
            there = {e.name for e in entries}
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(listed, dict) or not listed:
        return None
    missing = sorted(set(listed) - there)
    if missing:
        return f"{missing[0]} is listed in its {MANIFEST} but missing" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        )
    stray = sorted(there - set(listed) - SHARD_EXTRAS)
    return f"{stray[0]} is not in its {MANIFEST}" if stray else None


def verified_damage(record: str = VERIFIED) -> tuple[dict[int, str], str | None]:
    """({shard: first damaged line}, the export's first damaged line or None) from the last verify, for the
    places not made again since it ran (their manifest is older than the record)."""
    try:
        since = os.stat(record).st_mtime_ns
        with open(record, encoding="utf-8") as f:
            places = json.load(f)["places"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}, None
    shards: dict[int, str] = {}
    export = None
    for place, line in places.items() if isinstance(places, dict) else ():
        where = f"results/{place}"
        try:
            if os.stat(os.path.join(where, MANIFEST)).st_mtime_ns > since:
                continue  # made again after verify ran
        except FileNotFoundError:
            pass  # gone or unfinished: the other checks name it
        name = os.path.basename(place)
        if place == EXPORT.removeprefix("results/"):
            export = line
        elif name.startswith("shard_") and name[6:].isdigit():
            shards[int(name[6:])] = line
    return shards, export


def shards_made_into(downstream: str) -> set[str] | None:
    """The shard folders a downstream output was made from (the report's dataset_manifest.json lists them as
    `dir`, the export's manifest.json as `shard_dir`), normalized; None when that cannot be read."""
    path = os.path.join(downstream, MANIFEST) if os.path.isdir(downstream) else downstream
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        entries = data["shards"] if "shards" in data else data["sources"]
        return {os.path.normpath(e.get("dir") or e["shard_dir"]) for e in entries}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _failed(k: int, failure: str, keep_failed: bool, dryrun: bool = False) -> Heal:
    """A shard whose last validation failed. Every branch forces something: a kept shard is validated again, so
    the run fails (exit status 1) for as long as the damaged shard stays in place, never a green `Nothing to be
    done` over it."""
    folder, log, val = shard_dir(k), validate_log(k), validation_json(k)
    if keep_failed:
        return Heal(
            k,
            f"{folder} failed validation ({log}); kept in place (heal.keep_failed): validating it again, not "
            "extracting it; the run fails until it passes or is removed",
            val,
        )
    copies = failed_copies(k)
    if len(copies) >= MAX_REDOS:
        return Heal(
            k,
            f"{folder} failed validation again ({log}) after {len(copies)} redos ({', '.join(copies)}); "
            "not extracted again (the cause is not in the shard's files): validating it again, so the run fails "
            "until it passes or is removed",
            val,
        )
    move = WOULD_MOVE if dryrun else MOVING
    return Heal(
        k,
        f"{folder} failed validation ({failure[:200]}): {move} {next_failed_dir(k)} and extracting it again",
        folder,
        set_aside=True,
    )


def next_failed_dir(k: int) -> str:
    n = len(failed_copies(k))
    return f"{FAILED}/shard_{k}" + (f".{n}" if n else "")


def set_aside(heal: Heal) -> str:
    """Move a failed shard to results/failed/shard_k[.n]/ (hidden_states/, its failed validation report as
    validation.json, validate.log, extract.log) for study, so that its extract job starts from an empty folder;
    return where it went."""
    dest = Path(next_failed_dir(heal.shard))
    dest.mkdir(parents=True)
    os.rename(shard_dir(heal.shard), dest / "hidden_states")
    os.replace(paths.validation_failure(heal.shard), dest / paths.SET_ASIDE_VERDICT)
    for log, name in (
        (validate_log(heal.shard), "validate.log"),
        (paths.log(f"extract/shard_{heal.shard}"), "extract.log"),
    ):
        if os.path.exists(log):
            shutil.copy2(log, dest / name)
    return str(dest)


def summary(heals: list[Heal], shown: int = SHOWN, dryrun: bool = False) -> list[str]:
    """The lines said when the DAG is built: the first `shown` heals, then a count of the rest (`dryrun`: what a
    run would do; -n moves nothing)."""
    lines = [h.said(dryrun) for h in heals[:shown]]
    if len(heals) > shown:
        lines.append(f"... and {len(heals) - shown} more shards (the first {shown} are listed above)")
    return lines
