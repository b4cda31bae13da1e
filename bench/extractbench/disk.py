"""The disk's own write speed where the shards go, measured in the same run as the phases, and what
writing to disk costs phase (b) against /dev/shm."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def disk_write_speed(folder: Path, nbytes: int, streams: int = 1) -> float:
    """Write + fsync of `nbytes` in `folder` by `streams` files at once, bytes/s: the disk's own limit.
    Flushed as the worker flushes its layer files (BackgroundFlush, one file per layer)."""
    from eagle3prep.shard.files import BackgroundFlush

    block = os.urandom(1 << 24)
    blocks = max(1, nbytes // len(block) // streams)

    def one(k: int) -> None:
        path = folder / f"disk_speed_{k}.bin"
        with open(path, "wb", buffering=0) as f:
            flush = BackgroundFlush(f.fileno(), path.name)
            for _ in range(blocks):
                f.write(block)
                flush.wrote(len(block))
            flush.close()
            os.fsync(f.fileno())
        path.unlink()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return blocks * streams * len(block) / (time.perf_counter() - t0)


def disk_cost(b: dict) -> str:
    """What writing to disk costs phase (b)'s uniform shard: its time to disk minus to /dev/shm."""
    on_disk = b["uniform"]["tokens"] / b["uniform"]["tokens_per_s"]
    in_memory = b["uniform_shm"]["tokens"] / b["uniform_shm"]["tokens_per_s"]
    return (
        f"{on_disk:.2f} s to disk, {in_memory:.2f} s to /dev/shm: the disk costs {on_disk - in_memory:.2f} s "
        f"per shard of {b['uniform']['tokens']:,} tokens, {(on_disk - in_memory) / on_disk:.2f} of the shard's time"
    )
