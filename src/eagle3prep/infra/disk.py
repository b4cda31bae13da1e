"""Disk space as users read it: sizes in binary units, and a full disk reported as an error they can fix."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..errors import UserError


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as `df -h` prints them)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class DiskSpaceError(UserError, OSError):
    """The output filesystem cannot hold the shard: refused before writing, or full while writing."""


@contextlib.contextmanager
def disk_full_is_user_error(path: Path) -> Iterator[None]:
    """Turn ENOSPC while writing `path` into a DiskSpaceError that names the file and the free space."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        free = shutil.disk_usage(path.parent).free
        raise DiskSpaceError(
            f"disk full while writing {path}: {human_bytes(free)} ({free} bytes) free on its filesystem now; "
            "another job may have used the space since the pre-check. Finished shards are kept: free space or "
            "point results/ at a larger filesystem, then run the same command again (`snakemake plan` lists every "
            "shard's size)"
        ) from e
