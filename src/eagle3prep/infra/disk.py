"""A disk too small or full, reported as an error users can fix (sizes in binary units, units.human_bytes)."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..errors import UserError
from .units import human_bytes


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
