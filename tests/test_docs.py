"""The docs as a user reads them: a short README that says the commands CI and a GPU host
run, the rest in docs/guides/ by task, a config reference generated from the schema, and no link or cited
path that leads nowhere."""

import importlib.util
import re
import subprocess

from workflow_helpers import REPO

GUIDES = ("real-model", "reruns", "storage", "training", "regeneration", "cluster", "validation")
DOCS = [
    REPO / "README.md",
    REPO / "config" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "docs" / "guides").glob("*.md")),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path in backticks under one of the repository's own folders, e.g. `bench/bench_extract.py` or `docs/runs/fp8/`.
CITED = re.compile(r"`((?:docs|bench|scripts|tests|src|rules|envs|config|profiles|resources|\.ci)/[\w./-]*)`")
# A path cited with the commit that held it (a deleted one-off bench: git history keeps it), e.g.
# `bench/seed_sweep.py` at 69184f9: it must be in that commit.
AT_COMMIT = re.compile(r"`((?:bench|scripts|src)/[\w./-]*)` at ([0-9a-f]{7,40})\b")


def _config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_commit(commit: str, path: str) -> bool:
    """Whether git's history holds `path` at `commit` (a copy without .git cannot tell: taken as held)."""
    if not (REPO / ".git").exists():
        return True
    git = ["git", "-C", str(REPO), "cat-file", "-e", f"{commit}:{path}"]
    return subprocess.run(git, capture_output=True).returncode == 0


def test_readme_is_short_and_gives_the_commands_that_ci_and_a_gpu_host_run():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 8 * 1024, len(readme.encode())
    assert "make test" in (REPO / ".ci" / "run").read_text(encoding="utf-8")  # CI runs the README's command
    make = (REPO / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test", "gpu-env"):
        assert re.search(rf"^{target}:", make, re.M), f"Makefile has no {target} target"
        assert f"make {target}" in readme, f"the README does not give `make {target}`"
    assert "--configfile" in readme and "your whole config over the schema's defaults" in readme


def test_the_guides_exist_and_the_readme_links_each():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for name in GUIDES:
        assert (REPO / "docs" / "guides" / f"{name}.md").is_file(), name
        assert f"(docs/guides/{name}.md)" in readme, name
    assert "(config/README.md)" in readme


def test_every_link_and_cited_path_in_the_readme_and_guides_exists():
    broken = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor in the same page
            if not (doc.parent / target.split("#")[0]).resolve().exists():
                broken.append(f"{doc.relative_to(REPO)}: ({target})")
        historical = dict(AT_COMMIT.findall(text))
        for path, commit in historical.items():
            if not in_commit(commit, path):
                broken.append(f"{doc.relative_to(REPO)}: `{path}` at {commit}")
        for path in CITED.findall(text):
            # config/my-run.yaml is the file the guides tell the user to make
            if path in historical or path.startswith("config/my-run") or (REPO / path.rstrip(".")).exists():
                continue
            broken.append(f"{doc.relative_to(REPO)}: `{path}`")
    assert not broken, broken


def test_config_reference_is_generated_from_the_current_schema():
    module = _config_reference()
    import yaml

    expected = module.render(yaml.safe_load((REPO / "config" / "schema.yaml").read_text(encoding="utf-8")))
    assert (REPO / "config" / "README.md").read_text(encoding="utf-8") == expected, (
        "config/README.md is out of date: run python scripts/config_reference.py"
    )


def test_config_reference_lists_every_key_of_the_schema():
    import yaml

    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text(encoding="utf-8"))
    reference = (REPO / "config" / "README.md").read_text(encoding="utf-8")

    def keys(prefix, spec):
        for name, sub in spec.get("properties", {}).items():
            key = f"{prefix}.{name}" if prefix else name
            yield from keys(key, sub) if "properties" in sub else [key]

    missing = [k for k in keys("", schema) if f"| `{k}` |" not in reference]
    assert not missing, missing


# Docs are reference, not diaries: what is true now, with its evidence; the history is in git.
READER_DOCS = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if "runs" not in p.parts)]
DATE = re.compile(r"(?<![\w/.-])20\d\d-[01]\d-[0-3]\d(?![\w/])")  # not inside a path such as runs/ci_2026-12-02.txt
DIARY = re.compile(r"\bsessions?\b|\bissues?\s*#?\s*\d+|(?<![\w&/])#\d+\b", re.I)
EVIDENCE_TABLES = ("Throughput per capture path and vLLM version", "Validation matrix", "Supported vLLM range",
                   "Draft quality", "Long rows")  # fmt: skip


def diary_lines(name, text):
    """Lines of a doc that read as a diary: a heading with a date, a session, an issue number, or a date in prose
    (a date may stand only in a table row of docs/evidence.md, the day that row's figure was measured)."""
    hits = []
    for i, line in enumerate(text.splitlines(), 1):
        if DIARY.search(line):
            hits.append(f"{name}:{i}: {DIARY.search(line)[0]!r}")
        elif DATE.search(line) and not (name == "docs/evidence.md" and line.startswith("|")):
            hits.append(f"{name}:{i}: date {DATE.search(line)[0]}")
    return hits


def test_no_doc_has_dated_headings_sessions_or_issue_numbers():
    hits = [h for doc in READER_DOCS for h in diary_lines(str(doc.relative_to(REPO)), doc.read_text(encoding="utf-8"))]
    assert not hits, hits


def test_the_diary_check_sees_each_kind():
    """The check above would pass in silence if a pattern were off: one planted line of each kind."""
    for line in ("## 2026-12-03, fourth device session", "### Results (2026-12-03)", "as issue 28 item 7 asks",
                 "see #28", "the third session's run", "measured on 2026-12-02, after the change",
                 "Issue #43: done"):  # fmt: skip
        assert diary_lines("docs/DESIGN.md", line), line
        assert diary_lines("docs/evidence.md", line), line  # outside a table row, evidence.md too
    for line in ("see [ci](runs/ci_2026-12-02.txt)", "`docs/runs/vllm_versions/2026-12-01/`", "sha256 of (#sec)",
                 "the 0.95 target, issue-free"):  # fmt: skip
        assert not diary_lines("docs/DESIGN.md", line), line
    assert not diary_lines("docs/evidence.md", "| 2026-12-02 | 8b3c59d | 0.97 |")
    assert diary_lines("docs/DESIGN.md", "| 2026-12-02 | 8b3c59d | 0.97 |")


def test_design_and_evidence_are_short_reference_and_the_diaries_are_gone():
    design, evidence = REPO / "docs" / "DESIGN.md", REPO / "docs" / "evidence.md"
    assert len(design.read_bytes()) <= 25 * 1024, len(design.read_bytes())
    assert len(evidence.read_bytes()) <= 15 * 1024, len(evidence.read_bytes())
    for diary in ("performance.md", "gpu-validation.md", "quality.md"):
        assert not (REPO / "docs" / diary).exists(), diary
    assert "(docs/evidence.md)" in (REPO / "README.md").read_text(encoding="utf-8")


def test_every_evidence_row_has_its_date_commit_command_and_printout():
    text = (REPO / "docs" / "evidence.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", text, re.M)
    for table in EVIDENCE_TABLES:
        assert any(h.startswith(table) for h in headings), table
    rows = [line for line in text.splitlines() if line.startswith("| 20")]
    assert len(rows) >= 30, len(rows)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert DATE.match(cells[0]), row
        assert re.fullmatch(r"[0-9a-f]{7,40}", cells[1]), row
        assert "`" in row, f"no command: {row}"
        links = LINK.findall(row)
        assert links and all(target.startswith("runs/") for target in links), f"no printout: {row}"
