"""Checksums only: every shard folder, and the export, against its own manifest (`snakemake verify`).

No reference recomputation and no job: each listed file's size and sha256 against the manifest
(shard.manifest.check_listed_file, the reader validate uses), the set of files, the layer files against
the layer ids, and each shard manifest's own sha256 where the dataset manifest or the export recorded
it. One line per damaged file, one summary line; damaged or missing means a non-zero exit.

    snakemake verify                          # the shards in the working directory's results/
    python -m eagle3prep.verify [RESULTS]     # the same, under RESULTS
Both check the shards results/tokenized/stats.json lists (dataset_shards), or every shard_* folder without it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from . import paths
from .errors import same_command
from .infra.atomic import sha256_file, write_json
from .infra.units import human_bytes
from .run import command
from .shard.layout import MANIFEST
from .shard.manifest import EXPORT_EXTRAS, check_listed_file, read_manifest, stray_files

# paths.py's names, under whatever results folder verify is pointed at (it may have been copied or moved).
HIDDEN_STATES, DATASET_MANIFEST, EXPORT, RECORD = (
    p.removeprefix("results/") for p in (paths.HIDDEN_STATES, paths.DATASET_MANIFEST, paths.EXPORT, paths.VERIFIED)
)
# hashlib and file reads release the GIL: a few threads keep several disks (or one NVMe) busy.
THREADS = 4


@dataclass
class Verdict:
    """What verify found: `damaged` holds one line per damaged or missing file."""

    damaged: list[str] = field(default_factory=list)
    shards: int = 0
    files: int = 0
    bytes: int = 0
    export_files: int | None = None  # None: no export to check
    left_alone: list[str] = field(default_factory=list)  # shard folders the tokenized shards do not list
    bad_places: dict[str, str] = field(default_factory=dict)  # shard folder / the export -> its first damaged line

    @property
    def ok(self) -> bool:
        return not self.damaged

    def add(self, place: str, line: str) -> None:
        """One damaged or missing file (`line`) in `place`, which needs redoing."""
        self.damaged.append(line)
        self.bad_places.setdefault(place, line)

    def summary(self, results: str | Path) -> str:
        export = "" if self.export_files is None else f" and the export's {self.export_files}"
        checked = f"{self.files} files of {self.shards} shards{export} ({human_bytes(self.bytes)})"
        if self.ok:
            return f"verify: ok: {checked} match their manifests"
        places = sorted(self.bad_places, key=_natural)
        # heal (eagle3prep.healing.heal) reads RECORD and redoes these places in the workflow's next run
        yours = "" if command.known() else " (with your --configfile and --directory)"
        return (
            f"verify: {len(self.damaged)} damaged of {checked}, in {', '.join(places)}; the next run of the same "
            f"command makes them again: {same_command()}{yours}"
        )

    def write_record(self, results: str | Path) -> None:
        """RECORD under `results`: the places found damaged, for the next run to redo (heal.verified_damage). A
        healthy folder with no damage recorded is left as it is (verify changes nothing there); a record of
        earlier damage is cleared."""
        path = Path(results) / RECORD
        places = dict(sorted(self.bad_places.items()))
        if not places:
            try:
                if not json.loads(path.read_text(encoding="utf-8")).get("places"):
                    return
            except FileNotFoundError:
                return
            except (OSError, ValueError, AttributeError):
                pass  # unreadable: written again
        write_json(path, {"places": places})


def _natural(name: str) -> tuple:
    """shard_2 before shard_10."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _recorded_manifest_sha(results: Path) -> dict[str, tuple[str, str]]:
    """{shard folder name: (sha256 of its manifest.json, where it is recorded)} from the dataset manifest and
    the export's sources; the report and the export pinned the shards they read this way."""
    out: dict[str, tuple[str, str]] = {}
    for rel, key, dir_key in (
        (DATASET_MANIFEST, "shards", "dir"),
        (f"{EXPORT}/{MANIFEST}", "sources", "shard_dir"),
    ):
        path = results / rel
        if not path.is_file():
            continue
        data = _load_json(path)
        for s in data.get(key) or []:
            if isinstance(s, dict) and s.get("manifest_sha256") and s.get(dir_key):
                out.setdefault(Path(s[dir_key]).name, (s["manifest_sha256"], str(path)))
    return out


def _load_json(path: Path) -> dict[str, Any]:
    from .errors import UserError

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e}); rebuild it (rm it and run snakemake)") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a manifest (a JSON object expected)")
    return data


def _shard_jobs(folder: Path, name: str, recorded: dict, verdict: Verdict) -> Iterator[tuple[str, Path, dict, str]]:
    """Problems found without reading data go straight to `verdict`; the files to hash are yielded."""
    if not folder.is_dir():
        verdict.add(f"{HIDDEN_STATES}/{name}", f"{name}: missing (not extracted yet, or removed)")
        return
    try:
        m = read_manifest(folder)
    except (FileNotFoundError, ValueError, AttributeError) as e:  # AttributeError: JSON that is not an object
        what = "missing: the capture did not finish" if isinstance(e, FileNotFoundError) else str(e)
        verdict.add(f"{HIDDEN_STATES}/{name}", f"{name}/{MANIFEST}: {what}")
        return
    verdict.shards += 1
    problems = []
    ok, detail = m.layer_files_match()
    if not ok:
        problems.append(f"{name}/{MANIFEST}: layer files {detail}")
    if name in recorded and (sha := sha256_file(folder / MANIFEST)) != recorded[name][0]:
        problems.append(f"{name}/{MANIFEST}: sha256 {sha[:12]} != {recorded[name][0][:12]} ({recorded[name][1]})")
    problems += [f"{name}/{stray}: not in the manifest" for stray in stray_files(folder, set(m.files))]
    for line in problems:
        verdict.add(f"{HIDDEN_STATES}/{name}", line)
    for file, entry in sorted(m.files.items()):
        yield f"{name}/{file}", folder / file, entry, f"{HIDDEN_STATES}/{name}"


def _export_jobs(export: Path, verdict: Verdict) -> Iterator[tuple[str, Path, dict, str]]:
    m = _load_json(export / MANIFEST)
    files = m.get("files")
    if not isinstance(files, dict):
        verdict.add(EXPORT, f"{EXPORT}/{MANIFEST}: no `files` listing")
        return
    verdict.export_files = len(files)
    stray = stray_files(export, set(files), EXPORT_EXTRAS)
    for name in stray:
        verdict.add(EXPORT, f"{EXPORT}/{name}: not in the manifest")
    for file, entry in sorted(files.items()):
        yield f"{EXPORT}/{file}", export / file, entry, EXPORT


def dataset_shards(results: str | Path) -> list[int] | None:
    """The shards of the dataset in `results`: those results/tokenized/stats.json lists (written with the
    tokenized shards the last run made), None without it. A shard folder beyond them was left by a config with
    more shards; `snakemake verify`, python -m eagle3prep.verify and HiddenStatesDataset.from_results leave it alone."""
    try:
        stats = json.loads((Path(results) / "tokenized" / "stats.json").read_text(encoding="utf-8"))
        return sorted(int(s["shard"]) for s in stats["shards"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def verify(results: str | Path = "results", shards: list[int] | None = None, threads: int = THREADS) -> Verdict:
    """Check the shards `shards` (None: dataset_shards, else every shard_* folder or tokenized shard) under
    `results`, and the export if it exists."""
    results = Path(results)
    hs = results / HIDDEN_STATES
    folders = [p.name for p in hs.glob("shard_*") if re.fullmatch(r"shard_\d+", p.name)]
    shards = dataset_shards(results) if shards is None else shards
    if shards is None:  # the folders there, and one per tokenized shard (a removed folder is missing, not gone)
        found = folders + [p.stem for p in (results / "tokenized").glob("shard_*.jsonl")]
        names = sorted({n for n in found if re.fullmatch(r"shard_\d+", n)}, key=_natural)
    else:
        names = [f"shard_{k}" for k in shards]
    verdict = Verdict(left_alone=sorted(set(folders) - set(names), key=_natural))
    recorded = _recorded_manifest_sha(results)
    jobs = [j for name in names for j in _shard_jobs(hs / name, name, recorded, verdict)]
    verdict.files = len(jobs)
    if (results / EXPORT / MANIFEST).is_file():
        jobs += _export_jobs(results / EXPORT, verdict)

    def check(job: tuple[str, Path, dict, str]) -> tuple[bool, str]:
        return check_listed_file(job[1], job[2])

    with ThreadPoolExecutor(max_workers=max(threads, 1)) as pool:
        for (label, _, entry, place), (ok, detail) in zip(jobs, pool.map(check, jobs), strict=True):
            verdict.bytes += entry.get("bytes", 0)
            if not ok:
                verdict.add(place, f"{label}: {detail}")
    return verdict


def report(verdict: Verdict, results: str | Path, out=sys.stderr) -> None:
    """The damaged lines, a line for the folders left alone, then the summary line."""
    for line in verdict.damaged:
        print(line, file=out)
    if verdict.left_alone:
        print(
            f"not checked: {', '.join(verdict.left_alone)} (not in {Path(results) / 'tokenized/stats.json'}: left "
            "by a config with more shards, not part of this dataset)",
            file=out,
        )
    print(verdict.summary(Path(results)), file=out)


@dataclass(frozen=True, slots=True)
class VerifyPaths:
    """The verify job's files: the results folder it checks (and records its verdict in), and its log."""

    results: str | Path
    log_path: str | Path


@dataclass(frozen=True, slots=True)
class VerifyJobSettings:
    """What the verify job reads: no config key (it checks files against their manifests), only `threads`, the
    job's Snakemake threads, its files hashed at once."""

    threads: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, threads: int) -> Self:
        return cls(threads)


def run_verify_job(paths: VerifyPaths, settings: VerifyJobSettings) -> Verdict:
    """The verify rule's job: every damaged file and the summary to stderr (the terminal, what the user ran it for),
    the summary to `log_path` too, and the verdict recorded for the next run to redo what it found damaged."""
    results = paths.results
    verdict = verify(results, threads=settings.threads)
    verdict.write_record(results)
    report(verdict, results, sys.stderr)
    Path(paths.log_path).write_text(verdict.summary(results) + "\n", encoding="utf-8")
    return verdict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", default="results", help="the results folder (default: results)")
    ap.add_argument("--threads", type=int, default=THREADS, help=f"files hashed at once (default {THREADS})")
    args = ap.parse_args(argv)
    from .errors import one_line_errors

    with one_line_errors():
        if not (Path(args.results) / HIDDEN_STATES).is_dir():
            from .errors import UserError

            raise UserError(f"{args.results}: no {HIDDEN_STATES}/ folder; give the results folder of a run")
        verdict = verify(args.results, threads=args.threads)
        verdict.write_record(args.results)
        report(verdict, args.results, sys.stdout)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
