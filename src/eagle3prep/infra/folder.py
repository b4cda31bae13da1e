"""One output folder's lifecycle, the same for extract, regenerate and export (DESIGN.md §4).

`open_folder` removes what an earlier or killed run left there: the manifest first (a stale manifest must never
describe new files), then temp files and the stage's own named outputs. The stage writes its files atomically
(atomic.py). `finish_folder` writes timings.json, passes the stage's kill point, then writes manifest.json
last, so a folder with a manifest is whole and one without it is redone.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from . import faults
from .atomic import fsync_dir, remove_stale_temps, sha256_file, write_json

MANIFEST = "manifest.json"
TIMINGS = "timings.json"  # wall-clock facts: outside the manifest, so that equal data gives equal manifest bytes


def open_folder(path: str | os.PathLike, outputs: tuple[str, ...] = ()) -> Path:
    """`path` made ready for a new run: created, its manifest removed, then its temp files and the files or
    folders matching the glob patterns `outputs` (a folder shared with other files is cleared by name)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    remove_stale_temps(out)
    for pattern in outputs:
        for p in out.glob(pattern):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return out


def file_entry(path: str | os.PathLike) -> dict[str, Any]:
    """A manifest's entry for one finished file: its sha256 and size."""
    return {"sha256": sha256_file(path), "bytes": Path(path).stat().st_size}


def finish_folder(
    out: Path,
    manifest: dict[str, Any],
    timings: dict[str, Any] | None = None,
    kill_point: tuple[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """timings.json (when given), the folder's entries made durable, the stage's fault-injection point
    (faults.kill_point(name, **labels): a test kills the job here), then manifest.json last."""
    if timings is not None:
        write_json(out / TIMINGS, timings)
    fsync_dir(out)
    if kill_point is not None:
        faults.kill_point(kill_point[0], **kill_point[1])
    write_json(out / MANIFEST, manifest)
    return manifest
