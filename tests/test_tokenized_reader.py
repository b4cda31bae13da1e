"""One reader of the tokenized shards (shard/tokenized.py, DESIGN.md §3): what it gives, and that no other
module of the package parses those files itself."""

import ast
import json

from testkit.workflow import REPO

PACKAGE = REPO / "src" / "eagle3prep"
READER = "shard/tokenized.py"
# The other JSON-lines files the package reads, each by its own stage: none is a tokenized shard.
OTHER_JSONL = {
    "overfit_gate/train.py:summary": "the trainer's metrics.jsonl",
    "regenerate/review.py:sample_pairs": "prepared and regenerated conversations",
    "regenerate/stage.py:read_shard": "prepared conversations",
    "report/data.py:quarantine_facts": "quarantine files",
    "tokenize/row_inputs.py:_read_uris": "prepared conversations (their inline images)",
    "tokenize/rows.py:parse_conversation": "prepared conversations",
}


def line_parsers(path):
    """'module:function' of each json.load(s) of one line (a name `line`, or f.readline()) in a file."""
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else where
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr in ("loads", "load")
                and isinstance(child.func.value, ast.Name)
                and child.func.value.id == "json"
                and child.args
                and is_a_line(child.args[0])
            ):
                found.append(f"{path.relative_to(PACKAGE).as_posix()}:{where}")
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), "<module>")
    return found


def is_a_line(arg) -> bool:
    if isinstance(arg, ast.Name):
        return arg.id in ("line", "ln")
    return isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "readline"


def test_only_the_reader_parses_tokenized_shards():
    parsers = {p for path in sorted(PACKAGE.rglob("*.py")) for p in line_parsers(path)}
    strays = sorted(p for p in parsers if not p.startswith(READER) and p not in OTHER_JSONL)
    assert not strays, f"parse tokenized shards with eagle3prep.shard.tokenized, not json.loads: {strays}"
    assert any(p.startswith(READER) for p in parsers), "the scan no longer sees the reader's own parse"
    assert not set(OTHER_JSONL) - parsers, f"allowed entries that parse no line any more: {set(OTHER_JSONL) - parsers}"


def test_the_reader_gives_every_row_a_prefix_and_the_row_at_a_line(tmp_path):
    from eagle3prep.shard import tokenized

    want = [
        {"row": k, "id": f"c{k}", "input_ids": list(range(k + 1)), "loss_mask": [0] * k + [1], "seq_len": k + 1}
        for k in range(4)
    ]
    want[2]["images"] = [{"image": "é.png", "sha256": "0" * 64}]  # non-ASCII text reads back as written
    path = tmp_path / "shard_0.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in want), encoding="utf-8")
    assert list(tokenized.rows(path)) == want
    assert list(tokenized.rows(path, limit=2)) == want[:2]
    pos = 0
    for (line, row), expected in zip(tokenized.rows_with_lines(path), want, strict=True):
        assert row == expected and tokenized.row_at(path, pos) == expected
        pos += len(line)
    assert pos == path.stat().st_size  # the lines are the file's bytes, so a sha256 over them is the file's
    empty = tmp_path / "shard_1.jsonl"
    empty.write_bytes(b"")  # a shard past the last row is an empty file
    assert list(tokenized.rows(empty)) == []
