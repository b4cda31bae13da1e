"""Sizes and durations as users read them: bytes in binary units, a time in words, a time in a table cell."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as `df -h` prints them)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float, unit: str | None = None) -> str:
    """A time in the unit that reads: 7200 -> '2.0 h', 720 -> '12 min', 40 -> '40 s'; with a unit of work,
    'GPU' -> '2.0 GPU-hours', '12 GPU-minutes', '40 GPU-seconds'. Never under 1 s: a cost of '0 s' reads as none."""
    if seconds >= 3600:
        amount, short, long = f"{seconds / 3600:,.1f}", "h", "hours"
    elif seconds >= 60:
        amount, short, long = f"{seconds / 60:.0f}", "min", "minutes"
    else:
        amount, short, long = f"{max(seconds, 1):.0f}", "s", "seconds"
    return f"{amount} {short}" if unit is None else f"{amount} {unit}-{long}"


def compact_duration(seconds: float) -> str:
    """A time for a table column, fixed width to the minute or second: 3900 -> '1h05m', 187 -> '3m07s'."""
    h, rem = divmod(int(round(seconds)), 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
