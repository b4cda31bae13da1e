"""Project hygiene that no single module owns: no pickle for data, offline model access, no remote code by default,
no test fixture in the stages, and a repository that holds the product: no binary, dump or model file, and
docs/runs/ only the small text printouts behind the docs' figures."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3prep.config import validate_config

from testkit.workflow import REPO

# Loading pickles executes code from the file; data files here are safetensors, JSON or parquet only.
UNSAFE_LOAD = re.compile(r"^\s*(import|from)\s+(\w*pickle|dill|joblib)\b|\bpickle\.loads?\(|\btorch\.load\(", re.M)


def test_no_pickle_or_torch_load_in_the_code():
    hits = [
        f"{path.relative_to(REPO)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0).strip()}"
        for path in sorted([*(REPO / "src").rglob("*.py"), *(REPO / "scripts").rglob("*.py")])
        for text in [path.read_text(encoding="utf-8")]
        for m in UNSAFE_LOAD.finditer(text)
    ]
    assert not hits, f"pickle-based loading found (use safetensors/JSON): {hits}"


def test_the_rules_force_hugging_face_offline():
    common = (REPO / "rules" / "common.smk").read_text(encoding="utf-8")
    loop = re.search(r"for _var in \(([^)]*)\):\n\s+os\.environ\[_var\] = \"1\"", common)
    assert loop, "rules/common.smk no longer sets the HF offline variables to 1"
    assert set(re.findall(r'"(\w+)"', loop[1])) >= {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"}


def test_trust_remote_code_defaults_to_false_and_reaches_every_model_loading_rule():
    config = validate_config({"data": {"sources": ["x.jsonl"]}, "model": {"path": "m"}})
    assert config["model"]["trust_remote_code"] is False
    for rule in ("tokenize", "extract", "validate"):
        text = (REPO / "rules" / f"{rule}.smk").read_text(encoding="utf-8")
        assert "trust_remote_code=SETTINGS.model.trust_remote_code" in text, rule
    # That it is recorded in each shard manifest: test_corruption.py::test_good_shard_passes_every_check.


def test_no_module_of_the_package_scripts_or_benches_is_over_400_lines():
    """One concern a module (DESIGN.md §1): a file past 400 lines is split, not grown."""
    long = {
        str(p.relative_to(REPO)): n
        for folder in ("src", "scripts", "bench")
        for p in (REPO / folder).rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400
    }
    assert not long, long


def test_nothing_cites_a_file_outside_the_repository():
    """Facts from outside are copied in with their public source; a path beside the checkout means nothing
    to a reader of this repository."""
    outside = re.compile(r"\.\./shared/|\bresearch/[\w-]+\.md")
    cited = [
        f"{p.relative_to(REPO)}:{i}"
        for folder in ("src", "scripts", "bench", "rules", "tests", "docs", "config", "envs")
        for p in (REPO / folder).rglob("*")
        if p.is_file() and p.suffix in {".py", ".smk", ".md", ".yaml", ".txt", ".sh"} and "runs" not in p.parts
        for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if outside.search(line) and p.name != "test_hygiene.py"
    ]
    cited += [f"{name}:{i}" for name in ("README.md", "Makefile", "Snakefile")
              for i, line in enumerate((REPO / name).read_text(encoding="utf-8").splitlines(), 1)
              if outside.search(line)]  # fmt: skip
    assert not cited, cited


def _imported_modules(path, package):
    """Every module a Python file imports, relative imports resolved against `package` (its own package)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)  # from . import testing


KIT = ("testkit", "eagle3prep.testing")  # the test kit, and where it lived inside the package before


def _is_kit(module: str) -> bool:
    return any(module == k or module.startswith(k + ".") for k in KIT)


def kit_problems(root: Path = REPO) -> list[str]:
    """What puts the test kit (tests/testkit: tiny models, planted mistakes, test-only writers) back into the
    product: a kit folder inside the package, a module of the package or a script that imports it, a rule that
    names it. The wheel ships what the package holds, so a kit kept out of src/ stays out of the wheel."""
    src = root / "src"
    hits = [f"{p.relative_to(root)}: a test kit folder in the package" for p in sorted(src.rglob("*"))
            if p.is_dir() and p.name in ("testing", "testkit")]  # fmt: skip
    for path in sorted([*src.rglob("*.py"), *(root / "scripts").rglob("*.py")]):
        parts = path.relative_to(src).with_suffix("").parts if path.is_relative_to(src) else ("scripts", path.stem)
        package = ".".join(parts if path.name == "__init__.py" else parts[:-1]).removesuffix(".__init__")
        hits += [f"{path.relative_to(root)}: imports {m}" for m in _imported_modules(path, package) if _is_kit(m)]
    for rule in sorted([*(root / "rules").glob("*.smk"), root / "Snakefile"]):
        if rule.is_file():
            text = rule.read_text(encoding="utf-8")
            hits += [f"{rule.relative_to(root)}: names {k}" for k in KIT if re.search(rf"\b{re.escape(k)}\b", text)]
    return hits


def test_the_package_neither_holds_nor_imports_the_test_kit():
    assert not kit_problems()


def test_the_wheel_ships_the_package_only():
    """pyproject's package search, as setuptools runs it for the wheel: the workflow's package and nothing else."""
    import tomllib

    from setuptools import find_packages

    find = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"]
    packages = find_packages(where=str(REPO / find["find"]["where"][0]), include=find["find"]["include"])
    assert packages and all(p == "eagle3prep" or p.startswith("eagle3prep.") for p in packages), packages
    assert not [p for p in packages if _is_kit(p) or p.split(".")[-1] in ("testing", "testkit")], packages


def test_the_kit_check_sees_a_kit_folder_every_import_form_and_a_rule(tmp_path):
    """The check above would pass in silence if it missed a kind: one planted violation of each."""
    (tmp_path / "src/eagle3prep/shard").mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "rules").mkdir()
    (tmp_path / "src/eagle3prep/__init__.py").write_text("")
    (tmp_path / "rules/ok.smk").write_text('rule x:\n    shell: "python -m eagle3prep.demo"\n')
    assert kit_problems(tmp_path) == []
    planted = {
        "src/eagle3prep/a.py": "import testkit.tiny_models",
        "src/eagle3prep/b.py": "from testkit.writers import write_layer",
        "src/eagle3prep/c.py": "from .testing import planted",
        "src/eagle3prep/d.py": "from . import testing",
        "src/eagle3prep/shard/e.py": "from ..testing.planted import plant",
        "src/eagle3prep/f.py": "import eagle3prep.testing.matrix",
        "scripts/g.py": "from testkit import matrix",
        "rules/h.smk": 'rule h:\n    shell: "python -m testkit.tiny_vl out"',
    }
    for rel, code in planted.items():
        (tmp_path / rel).write_text(code + "\n")
    (tmp_path / "src/eagle3prep/testkit").mkdir()
    found = kit_problems(tmp_path)
    assert found[0] == "src/eagle3prep/testkit: a test kit folder in the package", found
    assert sorted({f.split(":")[0] for f in found[1:]}) == sorted(planted), found


# What the repository holds: the product, its inputs and the small text printouts behind the docs' figures.
# Binary files are inputs only: the demo's sample data and the tests' planted bad sources.
BINARY_INPUTS = ("resources/demo/", "tests/data/")
# Model weights, tensors, dumps, archives and images of runs: none is tracked anywhere (git history keeps the
# old ones; a bench writes them under its OUT folder).
REFUSED_SUFFIXES = {
    ".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".npz", ".npy", ".pkl", ".pickle", ".onnx", ".gguf", ".h5",
    ".arrow", ".gz", ".tgz", ".tar", ".zip", ".xz", ".bz2", ".zst", ".7z", ".whl", ".so", ".png", ".jpg",
    ".jpeg", ".gif", ".webp", ".svg", ".pdf", ".lock", ".parquet",
}  # fmt: skip
RUNS, RUNS_SUFFIXES = "docs/runs/", {".txt", ".md", ".json", ""}  # "" : a step's `log`
RUN_FILE_MAX, RUNS_MAX = 100 * 1024, 3 * 1024 * 1024


def _tracked_files():
    """Every file git tracks in this checkout (a copy without .git: every file outside the ignored folders)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p and (REPO / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")


def tracking_problems(files, root=REPO):
    """What breaks the repository's hygiene among `files` (paths relative to `root`): a binary, dump or model
    file outside the inputs, a docs/runs file that is not a small text printout, docs/runs over its size."""
    problems, runs_bytes = [], 0
    for rel in files:
        path, suffix = root / rel, Path(rel).suffix.lower()
        data = path.read_bytes()
        if rel.startswith(BINARY_INPUTS):
            continue
        if suffix in REFUSED_SUFFIXES or b"\0" in data:
            problems.append(f"{rel}: binary, dump or model file (keep it out of git)")
        elif rel.startswith(RUNS):
            if suffix not in RUNS_SUFFIXES or "pyspy" in Path(rel).parts:
                problems.append(f"{rel}: docs/runs keeps text printouts only (.txt, .md, .json, log)")
            if len(data) > RUN_FILE_MAX:
                problems.append(f"{rel}: {len(data):,} bytes, over {RUN_FILE_MAX:,}: keep a trimmed summary")
            runs_bytes += len(data)
    if runs_bytes > RUNS_MAX:
        problems.append(f"docs/runs: {runs_bytes:,} bytes in all, over {RUNS_MAX:,}")
    return problems


def test_no_binary_dump_or_model_file_is_tracked_and_docs_runs_is_small_text():
    assert not tracking_problems(_tracked_files())


def test_the_tracking_check_refuses_binaries_dumps_and_big_printouts(tmp_path):
    """The check above would pass in silence if it missed a kind: one planted file of each."""
    planted = {
        "docs/runs/x/layer_2.safetensors": b"{}",
        "docs/runs/x/pyspy/core.txt.gz": b"\x1f\x8b\x08\0",
        "docs/runs/x/pyspy/core.txt": b"thread (1): MainThread 3\n",
        "docs/runs/x/dump.npz": b"PK",
        "docs/runs/x/screenshot.png": b"\x89PNG",
        "src/model.pt": b"\x80\x02",
        "bench/blob": b"a\0b",
        "docs/runs/big.txt": b"x" * (RUN_FILE_MAX + 1),
    }
    for rel, data in planted.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    problems = tracking_problems(list(planted), tmp_path)
    assert [p.split(":")[0] for p in problems] == list(planted)
    for rel, data in {"docs/runs/ok/log": b"phase a\n", "resources/demo/sample.parquet": b"PAR1\0"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    assert not tracking_problems(["docs/runs/ok/log", "resources/demo/sample.parquet"], tmp_path)
    many = []
    for i in range(31):  # 31 files of 100 KB: each fine, over 3 MB in all
        (tmp_path / f"docs/runs/m{i}.txt").write_bytes(b"x" * RUN_FILE_MAX)
        many.append(f"docs/runs/m{i}.txt")
    assert tracking_problems(many, tmp_path)[-1].startswith("docs/runs: ")


# bench/ holds the regression benches a maintainer re-runs, not one-off investigations (git history keeps those).
# The budget grows only with a claim a bench backs (the GPU fault matrix, the trainer's pace on each format, the disk
# per billion tokens, thinking-length rows captured end to end came with theirs).
BENCH_MAX_LINES = 4850


def _docstring_spans(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (a module's, a class's, a function's)."""
    spans = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                spans.add(id(first.value))
    return spans


def bench_problems(root: Path = REPO) -> list[str]:
    """What keeps bench/ from being the maintainer's benches only: over BENCH_MAX_LINES lines of Python, a module
    without a docstring, a script (`__main__`) without argparse's --help, and a test or test helper that loads
    bench code: imports a bench module by name (after a sys.path insert) or names a path into bench/ in code
    (spec_from_file_location, sys.path, subprocess), anywhere but in a docstring. The tests test the package."""
    files = sorted((root / "bench").rglob("*.py"))
    problems = []
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in files)
    if lines > BENCH_MAX_LINES:
        problems.append(f"bench: {lines} lines of Python, over {BENCH_MAX_LINES}")
    for p in files:
        text = p.read_text(encoding="utf-8")
        if not ast.get_docstring(ast.parse(text)):
            problems.append(f"{p.relative_to(root)}: no module docstring")
        if '__name__ == "__main__"' in text and "argparse" not in text:
            problems.append(f"{p.relative_to(root)}: a script without argparse (no --help)")
    modules = {p.stem for p in files} | {p.parent.name for p in files if p.name == "__init__.py"}
    for p in sorted((root / "tests").rglob("*.py")):
        if p.name == "test_hygiene.py":  # this file reads bench/ as data
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        docs, found = _docstring_spans(tree), []
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module.split(".")[0]]
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docs
                and (node.value == "bench" or node.value.startswith("bench/"))
            ):
                found.append((node.lineno, f"a path into bench/ ({node.value!r})"))
            found += [(node.lineno, f"imports bench's {n}") for n in names if n in modules]
        problems += [f"{p.relative_to(root)}:{line}: {what}" for line, what in sorted(found)]
    return problems


def test_bench_holds_documented_scripts_under_the_line_budget_and_no_test_loads_it():
    assert not bench_problems()


def test_every_bench_script_answers_help():
    scripts = [p for p in sorted((REPO / "bench").rglob("*.py")) if '__name__ == "__main__"' in p.read_text()]
    assert scripts
    for script in scripts:
        run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.startswith("usage:"), (script, run.stderr[-2000:])


def test_the_bench_check_refuses_a_long_bench_an_undocumented_script_and_a_test_that_loads_bench(tmp_path):
    """The check above would pass in silence if it missed a kind: one planted violation of each."""
    (tmp_path / "bench/kit").mkdir(parents=True)
    (tmp_path / "bench/kit/__init__.py").write_text('"""A bench\'s parts."""\n')
    (tmp_path / "bench/ok.py").write_text('"""A bench."""\nimport argparse\nif __name__ == "__main__":\n    pass\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_fine.py").write_text('"""Runs bench/ok.py\'s logic from the package."""\nx = 1\n')
    assert bench_problems(tmp_path) == []
    (tmp_path / "bench/long.py").write_text('"""Long."""\n' + "x = 1\n" * BENCH_MAX_LINES)
    (tmp_path / "bench/bare.py").write_text('import sys\nif __name__ == "__main__":\n    sys.exit(0)\n')
    (tmp_path / "tests/test_a.py").write_text('import sys\nsys.path.insert(0, "bench/kit")\nfrom kit import x\n')
    (tmp_path / "tests/test_b.py").write_text('from pathlib import Path\np = Path("x") / "bench" / "ok.py"\n')
    assert bench_problems(tmp_path) == [
        f"bench: {1 + 4 + (1 + BENCH_MAX_LINES) + 3} lines of Python, over {BENCH_MAX_LINES}",
        "bench/bare.py: no module docstring",
        "bench/bare.py: a script without argparse (no --help)",
        "tests/test_a.py:2: a path into bench/ ('bench/kit')",
        "tests/test_a.py:3: imports bench's kit",
        "tests/test_b.py:2: a path into bench/ ('bench')",
    ]


PACKAGE = REPO / "src" / "eagle3prep"
# At most this many modules at the package's root: the config layer and what every stage shares; a stage is a folder.
ROOT_MODULES_MAX = 12
# Import circles left on purpose, each with why (none today).
KNOWN_CIRCLES: set[frozenset[str]] = set()


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, imports inside functions included (a lazy import is still a
    tie: the two modules cannot be read, moved or tested apart). `from P import m` ties to P.m when m is a module."""
    files = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}  # fmt: skip
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                subs = [f"{base}.{alias.name}" for alias in node.names]
                targets = [s for s in subs if s in files] + ([base] if any(s not in files for s in subs) else [])
            else:
                continue
            for target in targets:
                while target and target not in files:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The groups of modules that import each other in a loop (strongly connected, two or more)."""
    reach = {m: set() for m in graph}
    for start in graph:
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in reach[start]:
                reach[start].add(m)
                todo += graph.get(m, ())
    groups = {frozenset({m} | {o for o in reach[m] if m in reach[o]}) for m in graph if m in reach[m]}
    return sorted(groups, key=sorted)


def test_no_import_circle_in_the_package():
    found = [sorted(c) for c in circles(import_graph()) if c not in KNOWN_CIRCLES]
    assert not found, f"modules that import each other in a loop: {found}; move what both need into a third"


def test_the_circle_check_sees_a_lazy_import(tmp_path):
    pkg = tmp_path / "eagle3prep"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from .y import f\n")
    (pkg / "a" / "y.py").write_text("def f():\n    from eagle3prep.a import x\n")
    assert circles(import_graph(pkg)) == [frozenset({"eagle3prep.a.x", "eagle3prep.a.y"})]


# The capture seam (DESIGN.md §5): the interface imports no engine's wing, one module makes every backend.
ENGINE_BACKENDS = {"eagle3prep.backends.hf", "eagle3prep.vllm.capture.backend"}
CAPTURE_CLASS_MAX_LINES = 150


def seam_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Imports that split the capture seam: backends/ reaching into vllm/, or an engine's backend made elsewhere
    than extract/backend.py."""
    into_wing = [f"{m} -> {d}" for m, deps in graph.items() if m.startswith("eagle3prep.backends") for d in deps
                 if d.startswith("eagle3prep.vllm")]  # fmt: skip
    makers = [f"{m} -> {d}" for m, deps in graph.items() for d in deps & ENGINE_BACKENDS
              if m != "eagle3prep.extract.backend" and not m.startswith("eagle3prep.vllm.capture")]  # fmt: skip
    return into_wing + makers


def test_the_capture_seam_is_one_factory_and_the_interface_imports_no_engine():
    assert not seam_breaks(import_graph())


def test_the_seam_check_sees_an_interface_importing_the_wing():
    graph = {"eagle3prep.backends.base": {"eagle3prep.vllm.registry"},
             "eagle3prep.validate.stage": {"eagle3prep.backends.hf"}, "eagle3prep.extract.backend": ENGINE_BACKENDS}  # fmt: skip
    assert seam_breaks(graph) == [
        "eagle3prep.backends.base -> eagle3prep.vllm.registry", "eagle3prep.validate.stage -> eagle3prep.backends.hf"
    ]  # fmt: skip


def test_no_class_of_the_vllm_capture_is_over_150_lines():
    """The capture's classes stay one concern each: the choice, the engine's arguments and the rows' requests are
    modules of their own (choice.py, engine_args.py, feed.py)."""
    long = [
        f"{path.relative_to(PACKAGE)}:{node.name} {node.end_lineno - node.lineno + 1}"
        for path in sorted((PACKAGE / "vllm" / "capture").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CAPTURE_CLASS_MAX_LINES
    ]
    assert not long, long


def test_the_package_root_holds_few_modules_and_stages_are_folders():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_MODULES_MAX, f"{len(root)} modules at src/eagle3prep/: {root}; put a stage in a folder"
    for stage in ("prepare", "regenerate", "tokenize", "extract", "validate", "report", "export", "overfit_gate"):
        assert (PACKAGE / stage / "__init__.py").is_file(), stage


# Each stage's rule, in rules/<stage>.smk, by its name (export's names the layout it writes).
STAGE_RULES = {"prepare": "prepare", "regenerate": "regenerate", "tokenize": "tokenize", "extract": "extract",
               "validate": "validate", "report": "report", "overfit_gate": "overfit_gate",
               "export": "export"}  # fmt: skip


def test_a_stage_is_one_folder_rule_and_script_whose_call_is_its_job_entry():
    """src/eagle3prep/<stage>/, rules/<stage>.smk and scripts/<stage>.py share the stage's name; the rule runs that
    script, and the script calls the stage's one entry, run_<stage>_job, defined in the stage's folder."""
    for stage, rule in STAGE_RULES.items():
        blocks = re.split(
            r"^\s*rule (\w+):", (REPO / "rules" / f"{stage}.smk").read_text(encoding="utf-8"), flags=re.M
        )
        body = dict(zip(blocks[1::2], blocks[2::2], strict=True)).get(rule, "")
        assert f'"../scripts/{stage}.py"' in body, f"rules/{stage}.smk: rule {rule} does not run scripts/{stage}.py"
        assert f"run_{stage}_job(" in (REPO / "scripts" / f"{stage}.py").read_text(encoding="utf-8"), stage
        defined = {
            node.name
            for path in (PACKAGE / stage).glob("*.py")
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef)
        }
        assert f"run_{stage}_job" in defined, f"src/eagle3prep/{stage}/ defines no run_{stage}_job"
