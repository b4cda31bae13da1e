"""One logging voice (eagle3prep.infra.log): every stage's lines read `[speaker] message` on the stderr of the
moment, once each, and no module of the package or script writes its own lines to stderr beside it."""

import ast
import io
import logging
import sys

from eagle3prep.infra.log import get_logger

from testkit.workflow import REPO

# The lines that are no log: a failed job's one-line error, and the messages of a command a user runs by hand.
OWN_STDERR = {
    "src/eagle3prep/errors.py",  # `error: ...`, the job's last line
    "src/eagle3prep/run/progress.py",  # the workflow's `eagle3prep: ...` lines, in Snakemake's own process
    "src/eagle3prep/regenerate/review.py",  # python -m eagle3prep.regenerate.review
    "scripts/config_reference.py",  # python scripts/config_reference.py --check
}


def test_each_speaker_writes_one_line_in_one_format_to_the_current_stderr(monkeypatch):
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    get_logger("validate").info("FAIL file:layer_2.safetensors: sha256 1 != 2")
    monkeypatch.setattr(sys, "stderr", second)  # a script points stderr at its log after the import
    get_logger("vllm connector").info("parts off")
    get_logger("tokenize").warning("warning: max_seq_len 9 is above the tokenizer's model_max_length 8")
    assert first.getvalue() == "[validate] FAIL file:layer_2.safetensors: sha256 1 != 2\n"
    assert second.getvalue() == (
        "[vllm connector] parts off\n[tokenize] warning: max_seq_len 9 is above the tokenizer's model_max_length 8\n"
    )


def test_a_root_handler_of_the_caller_does_not_write_each_line_twice(monkeypatch):
    out, root = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    handler = logging.StreamHandler(root)
    logging.getLogger().addHandler(handler)
    try:
        get_logger("export").info("done: 3 rows")
    finally:
        logging.getLogger().removeHandler(handler)
    assert out.getvalue() == "[export] done: 3 rows\n" and root.getvalue() == ""


def _writes_to_stderr(node: ast.AST) -> bool:
    """print(..., file=sys.stderr) or sys.stderr.write(...)."""
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Name) and node.func.id == "print":
        return any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in node.keywords)
    return ast.unparse(node.func) == "sys.stderr.write"


def test_no_module_or_script_writes_its_own_lines_to_stderr():
    files = sorted([*(REPO / "src").rglob("*.py"), *(REPO / "scripts").rglob("*.py")])
    hits = [
        f"{p.relative_to(REPO)}:{node.lineno}"
        for p in files
        if str(p.relative_to(REPO)) not in OWN_STDERR
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if _writes_to_stderr(node)
    ]
    assert not hits, f"write through eagle3prep.infra.log.get_logger: {hits}"


def test_the_stderr_check_sees_print_and_write():
    for code, seen in (
        ('print("x", file=sys.stderr)', True),
        ('sys.stderr.write("x")', True),
        ('print("x")', False),
        ('log.info("x")', False),
    ):
        assert _writes_to_stderr(ast.parse(code).body[0].value) is seen, code
