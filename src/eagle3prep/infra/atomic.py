"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader never sees a half-written file under its final name: either the old file (or none) or the
complete new one. Temp names start with ".tmp-" so they are easy to find and clean up.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from . import faults

TMP_PREFIX = ".tmp-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """Open a temp file next to `path`; on clean exit fsync it and rename it onto `path`.

    On an exception the temp file is removed and `path` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A writer of `path` killed before its rename left `.tmp-<name>.<8 random chars>`; one job owns each
    # output, so such a file is stale. Left there, a rerun's folder would differ from a clean run's.
    for stale in path.parent.glob(glob.escape(f"{TMP_PREFIX}{path.name}.") + "?" * 8):
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
    os.close(fd)
    try:
        with open(tmp, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        faults.kill_point("atomic.before_rename", file=path.name)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write `obj` as pretty, key-sorted JSON (byte-identical for equal objects)."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def write_jsonl(path: str | os.PathLike, rows: Any) -> int:
    """Atomically write an iterable of JSON-able objects, one per line. Returns the line count."""
    n = 0
    with atomic_open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")))
            f.write("\n")
            n += 1
    return n


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def remove_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Delete temp files (and temp folders: an export's staging) a killed writer left behind in `directory`;
    return what was removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = sorted(p for p in directory.iterdir() if p.name.startswith(TMP_PREFIX))
    for p in stale:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return stale
