"""How the same command redoes what healing found (run.heal), through Snakemake's own rules: heal tickets.

A job that must be redone gets one more input, the ticket `.eagle3prep/heal/<n>.json` of this run (n: one past the
last ticket), which the local rule `heal` makes. Snakemake then runs that job because its input is new, in a dry run
too, where the `heal` job is listed beside it: nothing is forced from outside the DAG, and no Snakemake internal is
read. A job keeps the last ticket that named it as its input, so the next run sees the same inputs and re-queues
nothing; a job never healed has no ticket input, so a results folder made before tickets existed re-queues nothing
either. The ticket job moves failed shards aside and marks the last report stale, under Snakemake's lock and before
the jobs it heals start.

Everything is asked from input functions, which Snakemake calls while it builds the DAG, only for the jobs of the
targets asked for: `snakemake verify` heals nothing, and the lines say only what the DAG will do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

from ..infra.atomic import atomic_open
from ..infra.log import get_logger
from . import heal, stale
from .mode import Mode

FOLDER = ".eagle3prep/heal"


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


def read_tickets(folder: str | os.PathLike = FOLDER) -> dict[int, frozenset[str]]:
    """{n: the jobs ticket n healed}; a ticket that cannot be read names none (its jobs keep an older one)."""
    out: dict[int, frozenset[str]] = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        stem = name.removesuffix(".json")
        if not (name.endswith(".json") and stem.isdigit()):
            continue
        try:
            jobs = json.loads(Path(folder, name).read_text(encoding="utf-8"))["jobs"]
        except (OSError, ValueError, KeyError, TypeError):
            jobs = []
        out[int(stem)] = frozenset(j for j in jobs if isinstance(j, str))
    return out


def ticket_path(n: int, folder: str | os.PathLike = FOLDER) -> str:
    return f"{folder}/{n}.json"


def request_path(n: int, folder: str | os.PathLike = FOLDER) -> str:
    """What the main process asks of ticket n's job (Healing.request)."""
    return f"{folder}/{n}.request.json"


class Healing:
    """One Snakemake process's healing: `ticket(job)` is the input function's answer for a job; `request` (onstart)
    and `make_ticket` (the `heal` job, in a process of its own) carry out what was found. `before` runs once, at
    the first question, with the Mode (the results-folder checks); `say` prints a line in the Snakefile's voice;
    `main`: the process that builds the whole DAG (a spawned or remote job's process only reads tickets)."""

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
        self.tickets: dict[int, frozenset[str]] = {}
        self.next = 1

    def start(self) -> Mode | None:
        """Once per process: read the tickets and, in the main process, find what to heal and say it."""
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
        return mode

    def ticket(self, job: str) -> list[str]:
        """The ticket input of `job`: this run's when it is redone, else the last one that named it, else none."""
        self.start()
        if job in self.due:
            self.asked.add(job)
            return [ticket_path(self.next, self.folder)]
        last = max((n for n, jobs in self.tickets.items() if job in jobs), default=None)
        return [ticket_path(last, self.folder)] if last is not None else []

    def is_due(self, job: str) -> bool:
        self.start()
        return job in self.due

    def request(self) -> None:
        """In the main process when the run starts (`onstart`, after the DAG is built, before any job): write what
        the `heal` job does, for the jobs the DAG holds. That job runs in a process of its own, which finds nothing."""
        if not self.asked:
            return
        heals = [asdict(self.due[j]) | {"job": j} for j in sorted(self.asked)]
        path = request_path(self.next, self.folder)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "w") as f:
            json.dump({"heals": heals}, f, indent=1)


def make_ticket(path: str, log: str | None = None, say: Callable[[str], None] | None = None) -> None:
    """The `heal` job: set failed shards aside, mark the last report stale, then write the ticket (atomically,
    last: a run killed before it healed nothing, and the next one finds the same). Its lines go to the terminal
    and to `log`."""
    say = say or get_logger("heal").info
    n = int(Path(path).name.removesuffix(".json"))
    request = Path(request_path(n, Path(path).parent))
    asked = json.loads(request.read_text(encoding="utf-8"))["heals"] if request.exists() else []
    heals = [heal.Heal(a["shard"], a["why"], a["force"], a["set_aside"]) for a in asked]
    lines = [f"redo {a['job']}: {a['why']}" for a in asked]
    for h in heals:
        if h.set_aside:
            lines.append(f"moved {heal.shard_dir(h.shard)} to {heal.set_aside(h)}")
            say(lines[-1])
    reasons = [h.why for h in heals if h.shard is not None]
    if reasons and stale.mark_stale(reasons):
        lines.append(f"marked {stale.REPORT} STALE until this run rebuilds it")
        say(lines[-1])
    if log:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        Path(log).write_text("".join(f"[heal] {line}\n" for line in lines), encoding="utf-8")
    with atomic_open(path, "w") as f:
        json.dump({"jobs": [a["job"] for a in asked], "why": [h.why for h in heals]}, f, indent=1)
    request.unlink(missing_ok=True)
