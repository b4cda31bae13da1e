"""A vLLM version as a tuple to compare (DESIGN.md §5); which vLLM is installed is registry.installed_version()."""

from __future__ import annotations

import re


def parse_version(version: str) -> tuple[int, int, int]:
    """'0.32.0' / '0.11.1rc2.dev5+gabc' / '0.10.1.1' -> (major, minor, patch)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"cannot read a vLLM version from {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
