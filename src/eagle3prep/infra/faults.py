"""Deterministic kill points for crash tests.

Set EAGLE3PREP_KILL_AT to a point name, optionally with conditions on its context, and the process
SIGKILLs itself there, e.g.

    EAGLE3PREP_KILL_AT="extract.between_batches:shard=1,batch=2"

By default the whole process group dies (the Snakemake run and all its jobs, like a node crash);
EAGLE3PREP_KILL_SCOPE=process kills only the job's own process, and EAGLE3PREP_KILL_SCOPE=interrupt
sends SIGINT to the group, as a terminal's Ctrl-C does, at that exact point (no race with a fast job).
EAGLE3PREP_KILL_SCOPE=raise raises PlantedError there instead: an exception inside a process that must
report it, such as vLLM's engine core running the hooks (tests/test_vllm_failures.py).
Unset, kill_point() costs one dictionary lookup.
"""

from __future__ import annotations

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
    elif scope == "raise":
        raise PlantedError(f"planted fault at {name}")
    elif scope == "interrupt":
        os.killpg(os.getpgid(0), signal.SIGINT)  # KeyboardInterrupt here, and Snakemake sees its Ctrl-C
        return
    os.killpg(os.getpgid(0), signal.SIGKILL)
