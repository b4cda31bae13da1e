"""How the same command redoes what healing found (healing.heal), through Snakemake's own rules: heal tickets.

A job that must be redone gets one more input, this run's ticket `.eagle3prep/heal/<n>.json` (n: one past the last
ticket), the output of the `heal` job (rules/heal.smk). Snakemake runs every job downstream of a job it runs, which
needs no `.snakemake/` metadata, so a results folder copied, moved or without `.snakemake/` heals exactly as one
with it, and a dry run lists the heal job and the jobs it redoes and writes nothing. `onstart` (after the DAG is
built, under Snakemake's lock, before any job) writes what the run carries out, for the jobs to redo that the DAG
holds, beside the ticket (`<n>.pending.json`); the heal job then sets failed shards aside, marks the last report
stale and writes the ticket. A job keeps the last ticket that named it as its input, so the next run sees the same
inputs and re-queues nothing; a job never healed has no ticket input.

What healing finds is asked once, at the first input function's question (Snakemake calls input functions only
for the jobs of the targets asked for: `snakemake verify` heals nothing), said once, and held: the input
functions only look it up, and nothing is written before the run starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from .. import paths
from ..infra.atomic import write_json
from ..report import stale
from . import heal

if TYPE_CHECKING:
    from ..run.mode import Mode

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


def pending_path(ticket: str | os.PathLike) -> str:
    """What `onstart` hands the heal job: the jobs to redo that the DAG holds, and why."""
    return str(ticket).removesuffix(".json") + ".pending.json"


class Healing:
    """One Snakemake process's healing: `ticket(job)` is the input function's answer for a job, `carry_out`
    (onstart) hands the heal job what to do. `before` runs once, at the first question, with the Mode (the
    results-folder checks); `say` prints a line in the Snakefile's voice; `main`: the process that builds the whole
    DAG (a spawned or remote job's process only reads tickets). The tickets are read when it is made (the Snakefile
    is read), so `path`, the heal job's output, is known to the rules."""

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
        self.tickets = read_tickets(folder)
        self.next = max(self.tickets, default=0) + 1
        self.path = ticket_path(self.next, folder)  # this run's ticket: the heal job's output
        self.executor = False  # a run or dry run: only then does a due job take this run's ticket

    def start(self) -> None:
        """Once per process, at the first question: in the main process, find what to heal and say it."""
        if self._started or not self.main:
            return
        self._started = True
        mode = self._mode()
        self._before(mode)
        if mode.touch:
            return
        self.executor = mode.executor
        heals = heal.find(self.shards, self.keep_failed, dryrun=not mode.jobs_run)
        self.due = {job_key(h.force): h for h in heals if h.force}
        for line in heal.summary(heals):
            self._say(line)

    def ticket(self, job: str) -> list[str]:
        """The ticket input of `job`: this run's when it is redone, else the last carried-out one that named it,
        else none."""
        self.start()
        if job in self.due and self.executor:
            self.asked.add(job)
            return [self.path]
        last = max((n for n, jobs in self.tickets.items() if jobs and job in jobs), default=None)
        return [ticket_path(last, self.folder)] if last is not None else []

    def is_due(self, job: str) -> bool:
        self.start()
        return job in self.due

    def carry_out(self) -> None:
        """`onstart`, in the main process of a run: hand the heal job the due jobs this DAG holds, and why."""
        if self.asked:
            jobs = sorted(self.asked)
            write_json(pending_path(self.path), {"jobs": jobs, "heals": [asdict(self.due[j]) for j in jobs]})


def run_heal_job(ticket: str, say: Callable[[str], None] = print) -> list[str]:
    """The heal job: for the jobs `onstart` named, set failed shards aside and mark the last report stale, then
    write the ticket that names them (last: a run killed before it healed nothing, and the next one finds the
    same). Returns the lines said."""
    pending = Path(pending_path(ticket))
    todo = json.loads(pending.read_text(encoding="utf-8"))
    heals = [heal.Heal(**h) for h in todo["heals"]]
    lines = [f"redo {j}: {h.why}" for j, h in zip(todo["jobs"], heals, strict=True)]
    for h in heals:
        if h.set_aside:
            lines.append(f"moved {heal.shard_dir(h.shard)} to {heal.set_aside(h)}")
    reasons = [h.why for h in heals if h.shard is not None]
    if reasons and stale.mark_stale(reasons):
        lines.append(f"marked {stale.REPORT} STALE until this run rebuilds it")
    for line in lines:
        say(line)
    write_json(ticket, {"jobs": todo["jobs"], "why": [h.why for h in heals], "started": True})
    pending.unlink()
    return lines
