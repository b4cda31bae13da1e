"""Project hygiene that no single module owns: no pickle for data, offline model access, no remote code by default."""

import re

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
