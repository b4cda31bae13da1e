"""A check's verdict, one type for every check: validation's families (validate/), the shard set's
agreement checks (shard/shardset.py) and the scalable window and logits checks.

It sits outside validate/ because shard/shardset.py, which the export and the dataset use too, makes
verdicts of this type, and the shard layer must not import the validate stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Check:
    """One named check: passed or not, and what it measured or found."""

    name: str
    ok: bool
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        """The validation report's entry (its `checks` list)."""
        return {"check": self.name, "ok": self.ok, "detail": self.detail}


class Checks:
    """The verdicts of one run, in the order the checks ran."""

    def __init__(self) -> None:
        self.items: list[Check] = []

    def add(self, name: str, ok: bool, detail: str = "") -> bool:
        self.items.append(Check(name, bool(ok), detail))
        return bool(ok)

    def extend(self, checks: Iterable[Check]) -> bool:
        """Record `checks`; whether all passed."""
        ok = True
        for c in checks:
            ok &= self.add(c.name, c.ok, c.detail)
        return ok

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.items if not c.ok]

    def to_json(self) -> list[dict[str, Any]]:
        return [c.to_json() for c in self.items]


def failed_line(failed: list[Check], shown: int = 5) -> str:
    """The failed checks in one line, as the validate job's error and the next run's healing say them."""
    names = ", ".join(f"{c.name} ({c.detail})" for c in failed[:shown])
    return f"{len(failed)} check(s) failed: {names}"


def report_failures(report: object) -> str | None:
    """failed_line of a validation report (its `checks` list, as written); None when it records no failed check."""
    entries = report.get("checks") if isinstance(report, dict) else None
    failed = [
        Check(str(e.get("check")), False, str(e.get("detail", "")))
        for e in entries if isinstance(e, dict) and e.get("ok") is False
    ] if isinstance(entries, list) else []  # fmt: skip
    return failed_line(failed) if failed else None
