"""Progress where the user looks: while a run is going, the main Snakemake process prints, every `interval`
seconds, one line per running extract job (the GPU work of a run, hours of it) with its tokens/s, the share of its
tokens done and its ETA, read from the progress bar the job writes to logs/extract/shard_{k}.log.

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

EXTRACT_LOG = "logs/extract/shard_{k}.log"
MANIFEST_OF = "results/hidden_states/shard_{k}/manifest.json"
INTERVAL_S = 60.0  # hours-long jobs: a line a minute shows movement without burying Snakemake's own lines
ENV = "EAGLE3PREP_PROGRESS_S"  # seconds between looks; 0 turns the lines off
TAIL = 8192
# tqdm's bar: "shard 3:  45%|####5     | 1.23k/2.74k [00:03<00:04, 345tok/s]"
BAR = re.compile(
    r"shard (\d+):\s*(\d+)%\|[^|]*\|\s*([\d.]+[kMGT]?)/([\d.]+[kMGT]?) \[([\d:]+)<([\d:?]+),\s*([\d.?]+[kMGT]?)tok/s\]"
)


@dataclass(frozen=True, slots=True)
class Progress:
    shard: int
    percent: int
    done: str  # tokens submitted, as tqdm scales them (1.23k)
    total: str
    rate: str  # tokens/s
    eta: str  # h:mm:ss or mm:ss; ? before the first rate

    def line(self) -> str:
        return (
            f"extract shard_{self.shard}: {self.percent}% of {self.total} tokens, {self.rate} tokens/s, "
            f"ETA {self.eta} (logs/extract/shard_{self.shard}.log)"
        )


def last_bar(log: str) -> Progress | None:
    """The last progress bar in a log; None when it has none (the engine is still starting)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    bars = BAR.findall(text)
    if not bars:
        return None
    k, pct, done, total, _, eta, rate = bars[-1]
    return Progress(int(k), int(pct), done, total, rate, eta)


def running(shards: Iterable[int], within_s: float, now: float | None = None) -> list[Progress | int]:
    """Each running extract job's progress (its shard number alone while its engine starts)."""
    now = time.time() if now is None else now
    out: list[Progress | int] = []
    for k in shards:
        log = EXTRACT_LOG.format(k=k)
        try:
            fresh = now - os.stat(log).st_mtime < within_s
        except FileNotFoundError:
            continue
        if fresh and not os.path.exists(MANIFEST_OF.format(k=k)):
            out.append(last_bar(log) or k)
    return out


def lines(shards: Iterable[int], within_s: float, now: float | None = None) -> list[str]:
    return [
        p.line() if isinstance(p, Progress) else f"extract shard_{p}: starting its engine (logs/extract/shard_{p}.log)"
        for p in running(shards, within_s, now)
    ]


def interval_s(environ: dict[str, str] | None = None) -> float:
    """The seconds between looks: EAGLE3PREP_PROGRESS_S when set (0 = off), else INTERVAL_S."""
    value = (environ if environ is not None else os.environ).get(ENV)
    try:
        return max(0.0, float(value)) if value else INTERVAL_S
    except ValueError:
        return INTERVAL_S


def start(shards: list[int], interval: float | None = None,
          emit: Callable[[str], None] | None = None) -> threading.Thread | None:  # fmt: skip
    """Print the running jobs' lines every `interval` seconds from a daemon thread (it ends with the process)."""
    interval = interval_s() if interval is None else interval
    if not interval:
        return None
    emit = emit or (lambda line: print(f"eagle3prep: {line}", file=sys.stderr, flush=True))

    def loop() -> None:
        while True:
            time.sleep(interval)
            for line in lines(shards, within_s=2 * interval):
                emit(line)

    thread = threading.Thread(target=loop, name="eagle3prep-progress", daemon=True)
    thread.start()
    return thread
