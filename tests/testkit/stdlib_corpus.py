"""The text of the quality bench's target (stdlib_target): the running interpreter's standard library, split by whole modules.

Every machine with Python has it and no network is needed. A module is held out for evaluation when
the sha256 of its path relative to the stdlib folder falls in the last tenth, so the split does not
depend on file order or on which other modules a Python version ships. Conversations are built from
the code itself: the user gives a function's signature and docstring, the assistant writes the body;
or the user gives a file's first lines and the assistant continues it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Folders that are tests, data or tooling rather than library code, and the vendored site-packages.
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "lib2to3", "idlelib", "turtledemo", "__pycache__"}
HELD_OUT_SHARE = 0.1
FUNC_MIN_CHARS, FUNC_MAX_CHARS = 120, 2400
HEAD_LINES, CONT_LINES = 12, 24


@dataclass(frozen=True)
class Module:
    rel: str  # path relative to the stdlib folder, '/'-separated
    text: str

    @property
    def held_out(self) -> bool:
        h = int.from_bytes(hashlib.sha256(self.rel.encode()).digest()[:8], "big")
        return h / 2**64 >= 1 - HELD_OUT_SHARE


def stdlib_modules(root: Path | None = None, max_modules: int | None = None) -> list[Module]:
    """Every readable .py file of the stdlib outside SKIP_PARTS, sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if SKIP_PARTS & set(rel.split("/")) or rel.startswith("test_"):
            continue
        try:
            out.append(Module(rel, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue  # a few encoding test fixtures; not library text
    return out[:max_modules] if max_modules else out


def corpus_sha256(modules: list[Module]) -> str:
    """One hash of the whole corpus (paths and texts): two builds saw the same text iff it agrees."""
    h = hashlib.sha256()
    for m in modules:
        h.update(m.rel.encode() + b"\0" + m.text.encode() + b"\0")
    return h.hexdigest()


def _function_pairs(m: Module) -> list[tuple[str, str]]:
    """(signature + docstring, body after the docstring) of each documented function."""
    try:
        tree = ast.parse(m.text)
    except (SyntaxError, ValueError):
        return []
    lines = m.text.splitlines(keepends=True)
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or ast.get_docstring(node) is None:
            continue
        if len(node.body) < 2:
            continue  # a docstring-only function has no body to write
        start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
        split, end = node.body[0].end_lineno, node.end_lineno
        head, body = "".join(lines[start:split]), "".join(lines[split:end])
        if FUNC_MIN_CHARS <= len(head) + len(body) <= FUNC_MAX_CHARS and body.strip():
            pairs.append((head, body))
    return pairs


def conversations(m: Module) -> list[dict]:
    """The module's conversations, OpenAI shape, each with an id naming its source."""
    out = []
    for i, (head, body) in enumerate(_function_pairs(m)):
        prompt = f"Write the body of this function from `{m.rel}`:\n\n{head}"
        out.append({"id": f"{m.rel}#f{i}", "messages": _pair(prompt, body)})
    lines = m.text.splitlines(keepends=True)
    if len(lines) > HEAD_LINES + 4:
        head, cont = "".join(lines[:HEAD_LINES]), "".join(lines[HEAD_LINES : HEAD_LINES + CONT_LINES])
        if cont.strip():
            prompt = f"Continue the file `{m.rel}`:\n\n{head}"
            out.append({"id": f"{m.rel}#head", "messages": _pair(prompt, cont)})
    return out


def _pair(user: str, assistant: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
