"""Claim GPUs for one extract job with lock files (DESIGN.md §5).

Snakemake's `resources: gpus=N` only counts GPUs; it never sets CUDA_VISIBLE_DEVICES. When several
extract jobs share a host, each one must therefore pick *which* GPUs it uses. We take an exclusive
`fcntl.flock` on one file per GPU id in a lock folder; the kernel drops a flock when the process
dies, so a crashed job frees its GPUs without any cleanup.

An already-set CUDA_VISIBLE_DEVICES (SLURM, a user) is respected as it is.

    with claim_gpus(tp_size) as claim:   # sets CUDA_VISIBLE_DEVICES, e.g. "2,3"
        ...start vLLM...
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from .log import get_logger

log = get_logger("gpus")

LOCK_DIR_ENV = "EAGLE3PREP_GPU_LOCK_DIR"
NUM_GPUS_ENV = "EAGLE3PREP_NUM_GPUS"  # the host's GPU count, instead of nvidia-smi (tests: a fake set of ids)


class GpuClaimError(UserError, RuntimeError):
    """Not enough GPUs for tp_size, or none free in time; the message says what to change."""


DEFAULT_LOCK_DIR = "/tmp/eagle3prep-gpu-locks"


@dataclass
class GpuClaim:
    """GPU ids this process holds; `release()` (or leaving the `with` block) gives them back."""

    ids: list[int]
    source: str  # "CUDA_VISIBLE_DEVICES" (respected as set) | "locks" (claimed here) | "none" (tp_size 0)
    _fds: list[int] = field(default_factory=list, repr=False)
    _env_before: dict[str, str | None] = field(default_factory=dict, repr=False)

    def release(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the only descriptor drops the flock
        # Put the environment back as we found it, so a later claim in this process starts clean.
        for key, value in self._env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._fds = []
        self._env_before = {}

    def record(self) -> dict:
        """What timings.json keeps of this claim: the ids, how they were chosen, the CUDA_VISIBLE_DEVICES
        the job ran with (host GPU indices, in nvidia-smi's order, when claimed by locks) and when."""
        return {
            "ids": list(self.ids),
            "source": self.source,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES") if self.source != "none" else None,
            "claimed_at": round(time.time(), 3),
        }

    def __enter__(self) -> GpuClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def count_gpus() -> int:
    """Number of NVIDIA GPUs on this host, from nvidia-smi (0 when there is none).

    Not torch.cuda.device_count(): torch caches that count, and a CUDA_VISIBLE_DEVICES set after it
    would then be ignored in this process.
    """
    if os.environ.get(NUM_GPUS_ENV):
        return int(os.environ[NUM_GPUS_ENV])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return 0
    return sum(1 for line in out.splitlines() if line.strip())


def visible_ids(value: str) -> list[str]:
    """Entries of a CUDA_VISIBLE_DEVICES value ("0,1", "GPU-uuid,...", "" = none)."""
    return [v.strip() for v in value.split(",") if v.strip()]


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on `path`, or None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    # Who holds it, for a person looking at the lock folder (the lock itself is the flock).
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}\n".encode())
    return fd


def _lock_free_ids(n: int, num_gpus: int, lock_dir: Path) -> tuple[list[int], list[int]]:
    """Lock the first `n` free GPU ids; return (ids, fds). On too few free ids, lock none."""
    ids: list[int] = []
    fds: list[int] = []
    for gpu in range(num_gpus):
        fd = _try_lock(lock_dir / f"gpu{gpu}.lock")
        if fd is not None:
            ids.append(gpu)
            fds.append(fd)
            if len(ids) == n:
                return ids, fds
    for fd in fds:
        os.close(fd)
    return [], []


def _preset_claim(n: int, preset: str) -> GpuClaim:
    """An already-set CUDA_VISIBLE_DEVICES, respected as set; a larger set is fine (vLLM uses the first
    tp_size devices), a smaller one an error."""
    visible = visible_ids(preset)
    if len(visible) < n:
        raise GpuClaimError(
            f"extract.tp_size = {n} but CUDA_VISIBLE_DEVICES={preset!r} makes only {len(visible)} GPU(s) "
            "visible; lower extract.tp_size or request more GPUs from the scheduler (e.g. --gpus)"
        )
    return GpuClaim(ids=list(range(len(visible))), source="CUDA_VISIBLE_DEVICES")


def _wait_for_locks(n: int, total: int, lock_path: Path, wait_s: float, poll_s: float) -> tuple[list[int], list[int]]:
    """Lock `n` free GPUs of `total`, trying every `poll_s` seconds for up to `wait_s`: (ids, lock fds)."""
    deadline = time.monotonic() + wait_s
    while True:
        ids, fds = _lock_free_ids(n, total, lock_path)
        if ids:
            return ids, fds
        if time.monotonic() >= deadline:
            raise GpuClaimError(
                f"could not claim {n} free GPU(s) of {total} within {wait_s:.0f} s: other jobs hold the locks "
                f"in {lock_path} (a lock frees when its process exits); lower the number of parallel "
                "extract jobs (snakemake --resources gpus=...) or set CUDA_VISIBLE_DEVICES yourself"
            )
        time.sleep(poll_s)


def claim_gpus(
    n: int,
    *,
    lock_dir: str | os.PathLike | None = None,
    num_gpus: int | None = None,
    wait_s: float = 600.0,
    poll_s: float = 5.0,
) -> GpuClaim:
    """Make exactly `n` GPUs visible to this process and the workers it spawns.

    Args:
        n: GPUs needed (extract.tp_size).
        lock_dir: folder of the per-GPU lock files; default $EAGLE3PREP_GPU_LOCK_DIR or
            /tmp/eagle3prep-gpu-locks. Every job sharing the host must use the same folder.
        num_gpus: GPUs on the host; default from nvidia-smi (tests pass a fake count).
        wait_s: how long to wait for other jobs to free GPUs before giving up.
        poll_s: seconds between tries while waiting.
    """
    if n <= 0:
        return GpuClaim(ids=[], source="none")

    preset = os.environ.get("CUDA_VISIBLE_DEVICES")
    if preset is not None:
        return _preset_claim(n, preset)

    total = count_gpus() if num_gpus is None else num_gpus
    if total < n:
        raise GpuClaimError(
            f"extract.tp_size = {n} but this host has {total} GPU(s) (nvidia-smi); "
            "lower extract.tp_size or run the extract rule on a host with more GPUs"
        )

    lock_path = Path(lock_dir or os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)
    lock_path.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(PermissionError):
        lock_path.chmod(0o1777)  # shared by every user's jobs on the host, like /tmp

    ids, fds = _wait_for_locks(n, total, lock_path, wait_s, poll_s)
    env_keys = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    claim = GpuClaim(ids=ids, source="locks", _fds=fds, _env_before={k: os.environ.get(k) for k in env_keys})
    # nvidia-smi numbers GPUs in PCI bus order; CUDA's default order may differ.
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in ids)
    log.info(f"claimed GPU(s) {os.environ['CUDA_VISIBLE_DEVICES']} (locks in {lock_path})")
    return claim


def claim_job_gpus(n: int) -> GpuClaim:
    """The claim of one GPU job (extract, validate): `n` GPUs by lock, or nothing on a host without
    NVIDIA GPUs (vLLM's CPU build, the tests), where the job runs on the CPU or fails in one line."""
    if n <= 0 or ("CUDA_VISIBLE_DEVICES" not in os.environ and count_gpus() == 0):
        return GpuClaim(ids=[], source="none")
    return claim_gpus(n)
