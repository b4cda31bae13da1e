"""The config layer (config/, settings.py) stands below the stages: it imports none of them, directly or
through a module it imports, and no module of the package reaches into another's private names."""

import ast
from pathlib import Path

from testkit.workflow import REPO

PACKAGE = REPO / "src" / "eagle3prep"
CONFIG_LAYER = ("eagle3prep.config", "eagle3prep.settings")
STAGES = ("prepare", "tokenize", "regenerate", "extract", "validate", "shard", "report", "export", "overfit_gate",
          "train", "backends")  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> Path | None:
    """The file of package module `name`, or None when it is not one (a name imported from a module)."""
    base = PACKAGE.parent.joinpath(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def imports(path: Path, source: str | None = None) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) for every import of a file (or of `source` as if it were that file),
    relative imports resolved."""
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found = []
    source = path.read_text(encoding="utf-8") if source is None else source
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names]))
            found += [(f"{base}.{alias.name}", []) for alias in node.names]  # from . import prepare
    return found


def package_imports(path: Path, source: str | None = None) -> set[str]:
    """The package modules a file imports (a name imported from a module counts as its module)."""
    return {m for m, _ in imports(path, source) if m.startswith("eagle3prep") and module_path(m)}


def reached(start: tuple[str, ...]) -> dict[str, str]:
    """Every package module that `start` imports, directly or through others: {module: the module importing it}."""
    seen, todo = {}, list(start)
    while todo:
        name = todo.pop()
        for dep in package_imports(module_path(name)):
            if dep not in seen and dep not in start:
                seen[dep] = name
                todo.append(dep)
    return seen


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def test_the_config_layer_imports_no_stage():
    hits = [f"{via} -> {m}" for m, via in sorted(reached(CONFIG_LAYER).items()) if stage_of(m)]
    assert not hits, f"the config layer reaches a stage (move the constant into the config layer): {hits}"


def test_no_private_name_is_imported_across_modules():
    """A name that starts with _ is its module's own; another module that needs it needs a public name."""
    hits = [
        f"{path.relative_to(REPO)}: from {module} import {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for module, names in imports(path)
        if module.startswith("eagle3prep")
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not hits, hits


def test_the_import_walk_sees_every_form():
    """The checks above would pass in silence if the walk missed an import form a module could use."""
    assert stage_of("eagle3prep.shard.shardset") == "shard" and stage_of("eagle3prep.settings") is None
    path = PACKAGE / "settings.py"
    for code, want in (
        ("from .prepare import expand_sources", "eagle3prep.prepare"),
        ("from . import tokenize", "eagle3prep.tokenize"),
        ("import eagle3prep.shard.shardset", "eagle3prep.shard.shardset"),
        ("from eagle3prep.tokenize.vision import UNSUPPORTED", "eagle3prep.tokenize.vision"),
    ):
        assert want in package_imports(path, code), code
    assert ("eagle3prep.config", ["_one_line"]) in imports(path, "from .config import _one_line")
