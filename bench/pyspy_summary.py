"""Where each phase's main threads spent their time, from the py-spy samples bench/device/pending.sh takes.

    python bench/pyspy_summary.py OUT/pyspy [--top 8]    # OUT: the folder pending.sh wrote

pending.sh records 15 s of every bench_extract phase's processes every 40 s (`py-spy record --idle --threads
--format raw`, files `HHMMSS_<phase>_<core|driver>_<pid>.txt`, or .txt.gz: one line per distinct stack, `thread;frame;...
count`). For each phase and process, over all its files: the main thread's samples, the functions it was in
(the innermost frame, as a share of its samples) and, for those, the frames they were called from. Idle samples
count (`--idle`): a thread blocked on a lock or the GPU shows in `wait` or `synchronize`.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
from pathlib import Path

NAME = re.compile(r"\d{6}_(?P<phase>[a-z])_(?P<who>core|driver)_\d+\.txt(\.gz)?$")


def main_thread_stacks(path: Path):
    """(frames, samples) of each of the file's MainThread stacks, frames outermost first, thread name dropped."""
    data = path.read_bytes()
    raw = gzip.decompress(data) if path.suffix == ".gz" else data  # a run folder may hold them gzipped
    for line in raw.decode(errors="replace").splitlines():  # --nonblocking may read a frame mid-change
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if len(frames) > 1 and "MainThread" in frames[0] and count.isdigit():
            yield frames[1:], int(count)


def own_code(frames: list[str]) -> bool:
    """Whether eagle3prep's code runs in this stack of vLLM's engine-core process. Its frames below vLLM's entry
    (`run_engine_core`) are the ones the process was forked from (our driver starting the engine): not counted."""
    entry = max((i for i, x in enumerate(frames) if x.startswith("run_engine_core ")), default=-1)
    return any("eagle3prep/" in x for x in frames[entry + 1 :])


def short(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func file.py:123`."""
    m = re.match(r"(.*) \((?:.*/)?([^/]+)\)$", frame)
    return f"{m.group(1)} {m.group(2)}" if m else frame


def summarize(folder: Path, top: int) -> None:
    groups: dict[tuple[str, str], list[Path]] = collections.defaultdict(list)
    for f in sorted(folder.glob("*.txt*")):
        m = NAME.match(f.name)
        if m:
            groups[m["phase"], m["who"]].append(f)
    for (phase, who), files in sorted(groups.items()):
        leaf, callers, total, ours = collections.Counter(), collections.defaultdict(collections.Counter), 0, 0
        for f in files:
            for frames, n in main_thread_stacks(f):
                total += n
                leaf[short(frames[-1])] += n
                callers[short(frames[-1])][" < ".join(short(x) for x in reversed(frames[-4:-1]))] += n
                ours += n if own_code(frames) else 0
        print(f"({phase}) {who}: {total} main-thread samples in {len(files)} files")
        if not total:  # a window that caught the process as it exited
            continue
        if who == "core":
            print(f"  {ours / total:6.1%}  in eagle3prep's code (the hooks, the sink, the connector)")
        for func, n in leaf.most_common(top):
            via, _ = callers[func].most_common(1)[0]
            print(f"  {n / total:6.1%}  {func}   < {via}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    summarize(args.folder, args.top)


if __name__ == "__main__":
    main()
