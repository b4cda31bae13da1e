"""How the same command redoes what healing found (run.heal), through Snakemake's own rules: heal tickets.

A job that must be redone gets one more input, the ticket `.eagle3prep/heal/<n>.json` of this run (n: one past the
last ticket), written while Snakemake builds the DAG, so it exists and is newer than the job's outputs when
Snakemake decides what runs: "Updated input files" is Snakemake's mtime trigger, which needs no `.snakemake/`
metadata, so a results folder copied, moved or without `.snakemake/` heals exactly as one with it (with metadata,
the changed set of inputs says the same). A ticket made in the DAG names no job it heals until `onstart` (under
Snakemake's lock, before any job) has set failed shards aside, marked the last report stale and recorded the
ticket as carried out: a run refused before it starts leaves a ticket no later run reads. A job keeps the last
carried-out ticket that named it as its input, so the next run sees the same inputs and re-queues nothing; a job
never healed has no ticket input. A dry run's due jobs get `.eagle3prep/heal/dry-run.json`, made the same way and
removed when the process exits, so `-n` lists what the run would redo and leaves no ticket behind.

Everything is asked from input functions, which Snakemake calls while it builds the DAG, only for the jobs of the
targets asked for: `snakemake verify` heals nothing, and the lines say only what the DAG will do.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from ..infra.atomic import write_json
from . import heal, stale
from .mode import Mode

FOLDER = ".eagle3prep/heal"
DRY_RUN = "dry-run.json"  # a dry run's ticket, removed at exit


def job_key(force: str) -> str:
    """The job a heal redoes, as a ticket names it: `extract/3`, `validate/3` or `export`."""
    name = os.path.basename(force)
    if force == heal.EXPORT:
        return "export"
    if force.startswith(heal.HIDDEN_STATES):
        return f"extract/{name.removeprefix('shard_')}"
    if force.startswith(heal.VALIDATION):
        return f"validate/{name.removeprefix('shard_').removesuffix('.json')}"
    raise ValueError(f"no job makes {force}")


def read_tickets(folder: str | os.PathLike = FOLDER) -> dict[int, frozenset[str] | None]:
    """{n: the jobs ticket n healed, or None while it is not carried out (made in a DAG whose run has not started,
    or that never started)}; a ticket that cannot be read names none (its jobs keep an older one)."""
    out: dict[int, frozenset[str] | None] = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        stem = name.removesuffix(".json")
        if not (name.endswith(".json") and stem.isdigit()):
            continue
        try:
            data = json.loads(Path(folder, name).read_text(encoding="utf-8"))
            jobs = data["jobs"] if data.get("started", True) else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            jobs = []
        out[int(stem)] = None if jobs is None else frozenset(j for j in jobs if isinstance(j, str))
    return out


# What the due jobs' outputs are compared with when a job's own output is missing (Snakemake takes a later job's).
OUTPUTS_AFTER = ("results/report/report.html", "results/report/dataset_manifest.json", heal.EXPORT)


def _shard_outputs(k: int | None) -> tuple[str, ...]:
    return () if k is None else (heal.shard_dir(k), heal.validation_json(k))


def _mtime_ns(path: str | None) -> int:
    """The newest mtime of `path` and its Snakemake directory marker; 0 when missing."""
    out = 0
    for p in (path, os.path.join(path, heal.SNAKEMAKE_MARKER)) if path else ():
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            out = max(out, os.stat(p).st_mtime_ns)
    return out


def ticket_path(n: int, folder: str | os.PathLike = FOLDER) -> str:
    return f"{folder}/{n}.json"


class Healing:
    """One Snakemake process's healing: `ticket(job)` is the input function's answer for a job; `carry_out`
    (onstart) does what was found. `before` runs once, at the first question, with the Mode (the results-folder
    checks); `say` prints a line in the Snakefile's voice; `main`: the process that builds the whole DAG (a spawned
    or remote job's process only reads tickets)."""

    def __init__(
        self,
        shards: Iterable[int],
        keep_failed: bool,
        main: bool,
        mode: Callable[[], Mode],
        say: Callable[[str], None],
        before: Callable[[Mode], None] = lambda mode: None,
        folder: str | os.PathLike = FOLDER,
    ) -> None:
        self.shards, self.keep_failed, self.main = list(shards), keep_failed, main
        self._mode, self._before, self.folder, self._say = mode, before, folder, say
        self._started = False
        self.due: dict[str, heal.Heal] = {}  # job -> why, for the jobs this run redoes
        self.asked: set[str] = set()  # the due jobs the DAG holds (their input function was called)
        self.tickets: dict[int, frozenset[str] | None] = {}
        self.next = 1
        self.path: str | None = None  # this run's ticket (a dry run's: DRY_RUN), made when a job is due

    def start(self) -> Mode | None:
        """Once per process: read the tickets and, in the main process, find what to heal, say it and make the
        ticket the due jobs take as input."""
        if self._started:
            return None
        self._started = True
        self.tickets = read_tickets(self.folder)
        self.next = max(self.tickets, default=0) + 1
        if not self.main:
            return None
        mode = self._mode()
        self._before(mode)
        if mode.touch:
            return mode
        heals = heal.find(self.shards, self.keep_failed, dryrun=not mode.jobs_run)
        self.due = {job_key(h.force): h for h in heals if h.force}
        for line in heal.summary(heals):
            self._say(line)
        if self.due and mode.executor:
            self._make_ticket(dry=not mode.jobs_run)
        return mode

    def _make_ticket(self, dry: bool) -> None:
        """The ticket file, now, before Snakemake compares the due jobs' inputs with their outputs."""
        self.path = f"{self.folder}/{DRY_RUN}" if dry else ticket_path(self.next, self.folder)
        write_json(self.path, {"jobs": sorted(self.due), "started": False, "dry_run": dry})
        # Newer than every output the due jobs compare it with, also one dated ahead of this host's clock (a folder
        # from a host whose clock runs ahead): a redo too many is cheap, a silent pass is not.
        outputs = [p for h in self.due.values() for p in (h.force, *_shard_outputs(h.shard))]
        newest = max(map(_mtime_ns, [*outputs, *OUTPUTS_AFTER]), default=0)
        if newest >= (now := os.stat(self.path).st_mtime_ns):
            os.utime(self.path, ns=(now, newest + 10**9))
        if dry:
            atexit.register(Path(os.path.abspath(self.path)).unlink, missing_ok=True)

    def ticket(self, job: str) -> list[str]:
        """The ticket input of `job`: this run's when it is redone, else the last carried-out one that named it,
        else none."""
        self.start()
        if job in self.due and self.path:
            self.asked.add(job)
            return [self.path]
        last = max((n for n, jobs in self.tickets.items() if jobs and job in jobs), default=None)
        return [ticket_path(last, self.folder)] if last is not None else []

    def is_due(self, job: str) -> bool:
        self.start()
        return job in self.due

    def carry_out(self, log: str | None = None) -> list[str]:
        """In the main process when the run starts (`onstart`: after the DAG is built, under Snakemake's lock,
        before any job), for the due jobs the DAG holds: set failed shards aside, mark the last report stale, then
        record the ticket as carried out (last: a run killed before it healed nothing, and the next one finds the
        same). A ticket no job took is removed. Returns the lines said (also written to `log`)."""
        if not self.path or self.path.endswith(DRY_RUN):
            return []
        if not self.asked:
            Path(self.path).unlink(missing_ok=True)
            return []
        heals = [self.due[j] for j in sorted(self.asked)]
        lines = [f"redo {j}: {self.due[j].why}" for j in sorted(self.asked)]
        for h in heals:
            if h.set_aside:
                lines.append(f"moved {heal.shard_dir(h.shard)} to {heal.set_aside(h)}")
                self._say(lines[-1])
        reasons = [h.why for h in heals if h.shard is not None]
        if reasons and stale.mark_stale(reasons):
            lines.append(f"marked {stale.REPORT} STALE until this run rebuilds it")
            self._say(lines[-1])
        log = log or f"logs/heal/{Path(self.path).stem}.log"
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        Path(log).write_text("".join(f"[heal] {line}\n" for line in lines), encoding="utf-8")
        write_json(self.path, {"jobs": sorted(self.asked), "why": [h.why for h in heals], "started": True})
        return lines
