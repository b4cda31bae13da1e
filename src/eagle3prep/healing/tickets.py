"""How the same command redoes what healing found (healing.heal), through Snakemake's own rules: heal tickets.

A job that must be redone gets one more input, the ticket `.eagle3prep/heal/<n>.json` of this run (n: one past the
last ticket). It must exist and be newer than the job's outputs when Snakemake decides what runs: "Updated input
files" is Snakemake's mtime trigger, which needs no `.snakemake/` metadata, so a results folder copied, moved or
without `.snakemake/` heals exactly as one with it (a ticket that is only an output of another job would not do:
Snakemake remakes a missing input only for a job that runs for another reason). Snakemake reads no Snakefile hook
between the parse and the DAG's comparisons, so the ticket is written at parse time, by `prepare`, and removed when
the process exits unless `onstart` (under Snakemake's lock, before any job) carried it out: set failed shards aside,
marked the last report stale and recorded the jobs the DAG holds. A dry run, `--lint`, `verify` or a refused run
thus leaves no ticket. A job keeps the last carried-out ticket that named it as its input, so the next run sees the
same inputs and re-queues nothing; a job never healed has no ticket input.

The input functions only look up what `prepare` found; they write nothing. The first of them to ask runs the
results-folder checks with the Mode (a run or a dry run is known only once Snakemake builds the DAG) and says what
healing found, once. Snakemake calls them only for the jobs of the targets asked for: `snakemake verify` heals
nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from .. import paths
from ..infra.atomic import write_json
from . import heal

if TYPE_CHECKING:
    from ..infra.mode import Mode

FOLDER = paths.HEAL_TICKETS


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


def ticket_path(n: int, folder: str | os.PathLike = FOLDER) -> str:
    return f"{folder}/{n}.json"


# What the due jobs' outputs are compared with when a job's own output is missing (Snakemake takes a later job's).
OUTPUTS_AFTER = (paths.REPORT, paths.DATASET_MANIFEST, paths.EXPORT)


def _shard_outputs(k: int | None) -> tuple[str, ...]:
    return () if k is None else (paths.shard_dir(k), paths.validation_json(k))


def _mtime_ns(path: str | None) -> int:
    """The newest mtime of `path` and its Snakemake directory marker; 0 when missing."""
    out = 0
    for p in (path, os.path.join(path, heal.SNAKEMAKE_MARKER)) if path else ():
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            out = max(out, os.stat(p).st_mtime_ns)
    return out


class Healing:
    """One Snakemake process's healing: `prepare` (parse time) finds what to redo and writes the ticket, `ticket(job)`
    is the input function's answer for a job, `carry_out` (onstart) does what was found. `before` runs once, at the
    first question, with the Mode (the results-folder checks); `say` prints a line in the Snakefile's voice; `main`:
    the process that builds the whole DAG (a spawned or remote job's process only reads tickets)."""

    def __init__(
        self,
        shards: Iterable[int],
        keep_failed: bool,
        main: bool,
        mode: Callable[[], Mode],
        say: Callable[[str], None],
        before: Callable[[Mode], None] = lambda mode: None,
        folder: str | os.PathLike = FOLDER,
        mark_stale: Callable[[list[str]], str | None] = lambda reasons: None,
    ) -> None:
        self.shards, self.keep_failed, self.main = list(shards), keep_failed, main
        self._mode, self._before, self.folder, self._say = mode, before, folder, say
        self._mark_stale = mark_stale  # the report's (report.stale.mark_for_heal): the line it says, or None
        self.tickets = read_tickets(folder)
        self.next = max(self.tickets, default=0) + 1
        self.found: list[heal.Heal] = []
        self.due: dict[str, heal.Heal] = {}  # job -> why, for the jobs this run redoes
        self.asked: set[str] = set()  # the due jobs the DAG holds (their input function was called)
        self.path: str | None = None  # this run's ticket, written by prepare when a job is due
        self._started = self._carried_out = False

    def prepare(self) -> None:
        """At parse time, in the main process: find what to heal (listings and stats) and write the ticket the due
        jobs take as input, newer than their outputs; it is removed at exit unless carry_out ran."""
        if not self.main:
            return
        self.found = heal.find(self.shards, self.keep_failed)
        due = {job_key(h.force): h for h in self.found if h.force}
        if not due:
            return
        self.due, self.path = due, ticket_path(self.next, self.folder)
        write_json(self.path, {"jobs": sorted(due), "started": False})
        # Newer than every output the due jobs compare it with, also one dated ahead of this host's clock (a folder
        # from a host whose clock runs ahead): a redo too many is cheap, a silent pass is not.
        outputs = [p for h in due.values() for p in (h.force, *_shard_outputs(h.shard))]
        newest = max(map(_mtime_ns, [*outputs, *OUTPUTS_AFTER]), default=0)
        if newest >= (now := os.stat(self.path).st_mtime_ns):
            os.utime(self.path, ns=(now, newest + 10**9))
        atexit.register(self._remove_unless_carried_out, os.path.abspath(self.path))

    def _remove_unless_carried_out(self, path: str) -> None:
        if not self._carried_out:
            Path(path).unlink(missing_ok=True)

    def start(self) -> None:
        """Once, at the first question, in the main process: the results-folder checks, then what healing found,
        said (a dry run says what a run would do); --touch and a command that runs no job redo nothing."""
        if self._started or not self.main:
            return
        self._started = True
        mode = self._mode()
        self._before(mode)
        if mode.touch or not mode.executor:
            self.due = {}
            return
        for line in heal.summary(self.found, dryrun=not mode.jobs_run):
            self._say(line)

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
        same). Returns the lines said (also written to `log`)."""
        if not self.path or not self.asked:
            return []
        heals = [self.due[j] for j in sorted(self.asked)]
        lines = [f"redo {j}: {self.due[j].why}" for j in sorted(self.asked)]
        for h in heals:
            if h.set_aside:
                lines.append(f"moved {heal.shard_dir(h.shard)} to {heal.set_aside(h)}")
                self._say(lines[-1])
        reasons = [h.why for h in heals if h.shard is not None]
        if reasons and (marked := self._mark_stale(reasons)):
            lines.append(marked)
            self._say(lines[-1])
        log = log or paths.log(f"heal/{Path(self.path).stem}")
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        Path(log).write_text("".join(f"[heal] {line}\n" for line in lines), encoding="utf-8")
        write_json(self.path, {"jobs": sorted(self.asked), "why": [h.why for h in heals], "started": True})
        self._carried_out = True
        return lines
