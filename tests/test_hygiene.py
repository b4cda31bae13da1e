"""Project hygiene that no single module owns: no pickle for data, offline model access, no remote code by default,
no test fixture in the stages, and a repository that holds the product: no binary, dump or model file, and
docs/runs/ only the small text printouts behind the docs' figures."""

import ast
import re
import subprocess
from pathlib import Path

import pytest
from workflow_helpers import REPO

from eagle3prep.config import validate_config

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
        assert 'trust_remote_code=config["model"]["trust_remote_code"]' in text, rule
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


def test_no_stage_imports_the_test_fixtures():
    """Issue #26: the tiny model builders, planted mistakes and test-only writers live in eagle3prep.testing,
    for the tests and benches; a module of the package outside it, a script or a rule that imported them would
    put fixtures back on the data's path."""
    src, fixtures = REPO / "src", "eagle3prep.testing"
    hits = []
    for path in sorted([*(src / "eagle3prep").rglob("*.py"), *(REPO / "scripts").rglob("*.py")]):
        parts = path.relative_to(src).with_suffix("").parts if path.is_relative_to(src) else ("scripts", path.stem)
        if parts[:2] == ("eagle3prep", "testing"):
            continue
        package = ".".join(parts if path.name == "__init__.py" else parts[:-1]).removesuffix(".__init__")
        hits += [f"{path.relative_to(REPO)}: {m}" for m in _imported_modules(path, package)
                 if m == fixtures or m.startswith(fixtures + ".")]  # fmt: skip
    for rule in sorted([*(REPO / "rules").glob("*.smk"), REPO / "Snakefile"]):
        hits += [f"{rule.relative_to(REPO)}: {fixtures}" for line in rule.read_text(encoding="utf-8").splitlines()
                 if re.search(rf"\b{re.escape(fixtures)}\b", line)]  # fmt: skip
    assert not hits, f"a stage imports the test fixtures of {fixtures}: {hits}"


def test_the_fixture_check_sees_relative_and_absolute_imports(tmp_path):
    """The walk above would pass in silence if it missed an import form: each form a stage could use."""
    for code in (
        "from .testing import planted",
        "from . import testing",
        "import eagle3prep.testing.tiny_models",
        "from eagle3prep.testing.writers import write_layer",
        "from ..testing.planted import plant",
    ):
        path = tmp_path / "m.py"
        path.write_text(code + "\n")
        package = "eagle3prep.shard" if code.startswith("from ..") else "eagle3prep"
        assert any(m.startswith("eagle3prep.testing") for m in _imported_modules(path, package)), code


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
