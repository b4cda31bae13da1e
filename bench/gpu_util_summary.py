"""How busy the GPU was in each phase of bench_extract steps, from `nvidia-smi dmon -s u -o T -d 1` (pending.sh's
gpu_util.txt): whether a phase is paced by the GPU or leaves it idle waiting for its driver.

For each bench step in pending.sh's `done` file, the dmon samples inside the step's window are cut into bursts at
IDLE_GAP seconds or more of 0 % (the engine starts between phases); bursts with under MIN_BUSY busy seconds (a
compile's blips) are dropped and the rest are matched, in order, to the phases in the step's log (every round's). Per
phase: the timed seconds (tokens / rate, summed over its workloads), the GPU's busy seconds (sum of sm % / 100 over
the burst, which also holds warm-ups and the gaps between shards) and the tokens per busy second, the rate the GPU
would sustain if it were never idle.

    python bench/gpu_util_summary.py OUT    # OUT: the folder pending.sh wrote (done, gpu_util.txt, each step's log)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from summarize_extract_runs import rounds_of

IDLE_GAP = 15  # seconds of 0 % between two phases' bursts (an engine start takes 20 s or more)
MIN_BUSY = 10.0  # busy seconds under which a burst is not a phase's timed work


def seconds(hms: str) -> int:
    h, m, s = map(int, hms.split(":"))
    return h * 3600 + m * 60 + s


def samples(dmon: Path) -> list[tuple[int, int]]:
    """(time of day in s, sm %) of each sample."""
    out = []
    for line in dmon.read_text().splitlines():
        cols = line.split()
        if line.startswith("#") or len(cols) < 3 or not cols[2].isdigit():
            continue
        out.append((seconds(cols[0]), int(cols[2])))
    return out


def bursts(points: list[tuple[int, int]]) -> list[tuple[int, int, float]]:
    """(first s, last s, busy s) of each run of samples not broken by IDLE_GAP zeros, trailing zeros cut."""
    out, cur, zeros = [], [], 0
    for t, u in points + [(10**9, 0)] * IDLE_GAP:
        if u > 0 and cur and zeros >= IDLE_GAP:
            out.append(cur)
            cur = []
        zeros = 0 if u > 0 else zeros + 1
        if u > 0 or cur:
            cur.append((t, u))
    out.append(cur)
    result = []
    for b in out:
        while b and b[-1][1] == 0:
            b.pop()
        if b:
            result.append((b[0][0], b[-1][0], sum(u for _, u in b) / 100))
    return result


def steps(done: Path) -> list[tuple[str, int, int | None]]:
    """(name, start s, end s) of each step pending.sh started; end None for one cut short (the machine went)."""
    start, end = {}, {}
    for line in done.read_text().splitlines():
        if m := re.match(r"(\S+) start (\S+):", line):
            start[m[2]] = seconds(m[1])
        elif (m := re.match(r"(\S+) end (\S+) rc", line)) and m[2] in start:
            end[m[2]] = seconds(m[1])
    return [(name, t0, end.get(name)) for name, t0 in start.items()]


def step_phases(step: Path) -> list[tuple[str, dict]]:
    """(label, result) of each phase the step's log finished, in order, every round's (--rounds): the log holds
    them all, also when the step was cut short; bench_extract.json only round 1's."""
    out = []
    for r, phases in enumerate(rounds_of(step / "log") if (step / "log").is_file() else [], start=1):
        out += [(x if r == 1 else f"{x} round {r}", v) for x, v in phases.items()]
    return out


def phase_work(result: dict) -> tuple[int, float]:
    """(tokens, timed seconds) of one phase's workloads."""
    work = [v for v in result.values() if isinstance(v, dict) and "tokens_per_s" in v]
    return sum(w["tokens"] for w in work), sum(w["tokens"] / w["tokens_per_s"] for w in work)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a pending.sh output folder: gpu_util.txt, done, <step>/log")
    args = ap.parse_args()
    points = samples(args.run / "gpu_util.txt")
    for name, t0, t1 in steps(args.run / "done"):
        phases = step_phases(args.run / name)
        if not phases:
            continue
        window = [p for p in points if t0 <= p[0] <= (t1 if t1 is not None else 10**9)]
        found = [b for b in bursts(window) if b[2] >= MIN_BUSY]
        if t1 is None:  # cut short: the last burst may be a phase that never printed its result
            print(f"{name}: cut short; the {len(phases)} phases it finished, against its first bursts")
            found = found[: len(phases)]
        if len(found) != len(phases):
            print(f"{name}: {len(found)} bursts for phases {[x for x, _ in phases]}: not matched")
            continue
        for (phase, result), (b0, b1, busy) in zip(phases, found, strict=True):
            tokens, timed = phase_work(result)
            print(
                f"{name} ({phase}): {tokens:,} tokens timed {timed:.1f} s at {tokens / timed:,.0f} tok/s; burst "
                f"{b1 - b0 + 1} s, GPU busy {busy:.1f} s = {busy / timed:.2f} of the timed s; "
                f"{tokens / busy:,.0f} tokens per busy s"
            )


if __name__ == "__main__":
    main()
