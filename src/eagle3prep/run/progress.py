"""Progress where the user looks: while a run is going, the main Snakemake process prints, every `interval`
seconds, one line per running GPU job (extract's, hours of it, and the regenerate stage's) with its rate, the share
of its work done and its ETA, read from the progress bar the job writes to its log (logs/extract/shard_{k}.log: tokens;
logs/regenerate/shard_{k}.log: conversations, the unit its bar counts).

A job counts as running while its log is fresher than two intervals and its shard has no manifest yet; the log's
last bar is read from its last 8 KiB (tqdm rewrites its line with carriage returns), so each look costs a `stat`
and a small read per shard whose log exists.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import paths

EXTRACT_LOG = paths.log("extract/shard_{k}")
MANIFEST_OF = paths.shard_manifest()
INTERVAL_S = 60.0  # hours-long jobs: a line a minute shows movement without burying Snakemake's own lines
ENV = "EAGLE3PREP_PROGRESS_S"  # seconds between looks; 0 turns the lines off
TAIL = 8192


@dataclass(frozen=True, slots=True)
class Stage:
    """A GPU rule whose jobs show progress: where its log and its finished shard's manifest are, and its bar's unit."""

    name: str
    log: str
    manifest: str
    unit: str  # as tqdm writes it after the rate: tok, conv
    noun: str  # as the line says it

    def bar(self) -> re.Pattern[str]:
        # tqdm's bar: "shard 3:  45%|####5     | 1.23k/2.74k [00:03<00:04, 345tok/s]"; below one a second, tqdm
        # writes the inverse ("12.5s/conv").
        return re.compile(
            r"shard (\d+):\s*(\d+)%\|[^|]*\|\s*([\d.]+[kMGT]?)/([\d.]+[kMGT]?) \[([\d:]+)<([\d:?]+),\s*"
            rf"(?:([\d.?]+[kMGT]?){self.unit}/s|([\d.]+)s/{self.unit})\]"
        )


EXTRACT = Stage("extract", EXTRACT_LOG, MANIFEST_OF, "tok", "tokens")
REGENERATE = Stage(
    "regenerate", paths.log("regenerate/shard_{k}"), f"{paths.regen_shard()}/{paths.MANIFEST}", "conv",
    "conversations",
)  # fmt: skip
BAR = EXTRACT.bar()


@dataclass(frozen=True, slots=True)
class Progress:
    shard: int
    percent: int
    done: str  # work submitted, as tqdm scales it (1.23k)
    total: str
    rate: str  # units/s
    eta: str  # h:mm:ss or mm:ss; ? before the first rate
    stage: Stage = EXTRACT

    def line(self) -> str:
        st = self.stage
        return (
            f"{st.name} shard_{self.shard}: {self.percent}% of {self.total} {st.noun}, {self.rate} {st.noun}/s, "
            f"ETA {self.eta} ({st.log.format(k=self.shard)})"
        )


def last_bar(log: str, stage: Stage = EXTRACT) -> Progress | None:
    """The last progress bar in a log; None when it has none (the engine is still starting)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    bars = stage.bar().findall(text)
    if not bars:
        return None
    k, pct, done, total, _, eta, rate, inverse = bars[-1]
    if inverse:
        rate = f"{1 / float(inverse):.2g}" if float(inverse) else "?"
    return Progress(int(k), int(pct), done, total, rate, eta, stage)


def running(shards: Iterable[int], within_s: float, now: float | None = None,
            stage: Stage = EXTRACT) -> list[Progress | int]:  # fmt: skip
    """Each running job's progress (its shard number alone while its engine starts)."""
    now = time.time() if now is None else now
    out: list[Progress | int] = []
    for k in shards:
        log = stage.log.format(k=k)
        try:
            fresh = now - os.stat(log).st_mtime < within_s
        except FileNotFoundError:
            continue
        if fresh and not os.path.exists(stage.manifest.format(k=k)):
            out.append(last_bar(log, stage) or k)
    return out


def lines(shards: Iterable[int], within_s: float, now: float | None = None,
          regenerate_shards: Iterable[int] = ()) -> list[str]:  # fmt: skip
    """The lines of every running job: the regenerate stage's (which runs first), then extract's."""
    out = []
    for stage, ks in ((REGENERATE, regenerate_shards), (EXTRACT, shards)):
        out += [
            p.line()
            if isinstance(p, Progress)
            else f"{stage.name} shard_{p}: starting its engine ({stage.log.format(k=p)})"
            for p in running(ks, within_s, now, stage)
        ]
    return out


def interval_s(environ: dict[str, str] | None = None) -> float:
    """The seconds between looks: EAGLE3PREP_PROGRESS_S when set (0 = off), else INTERVAL_S."""
    value = (environ if environ is not None else os.environ).get(ENV)
    try:
        return max(0.0, float(value)) if value else INTERVAL_S
    except ValueError:
        return INTERVAL_S


def start(shards: list[int], interval: float | None = None, emit: Callable[[str], None] | None = None,
          regenerate_shards: Iterable[int] = ()) -> threading.Thread | None:  # fmt: skip
    """Print the running jobs' lines (regenerate_shards: the regenerate stage's, when it is on) every `interval` seconds from a daemon thread (it ends with the process)."""
    interval = interval_s() if interval is None else interval
    if not interval:
        return None
    emit = emit or (lambda line: print(f"eagle3prep: {line}", file=sys.stderr, flush=True))

    def loop() -> None:
        while True:
            time.sleep(interval)
            for line in lines(shards, within_s=2 * interval, regenerate_shards=regenerate_shards):
                emit(line)

    thread = threading.Thread(target=loop, name="eagle3prep-progress", daemon=True)
    thread.start()
    return thread
