"""Tests of eagle3prep.prepare: readers, normalization, quarantine reasons, dedup, counts."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3prep.config import validate_config
from eagle3prep.prepare import (
    REASONS,
    InputError,
    JsonlReader,
    NoConversationsError,
    Rejected,
    check_invariant,
    conversation_id,
    expand_sources,
    normalize,
    normalize_tools,
    require_conversations,
    summarize,
)
from eagle3prep.prepare.counts import loss_error

from testkit import calls

ROOT = Path(__file__).resolve().parents[1]


def sharegpt(user="hi", answer="hello", system=None):
    turns = [{"from": "system", "value": system}] if system is not None else []
    return {"conversations": [*turns, {"from": "human", "value": user}, {"from": "gpt", "value": answer}]}


def openai(user="hi", answer="hello", system=None):
    turns = [{"role": "system", "content": system}] if system is not None else []
    return {"messages": [*turns, {"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def run(tmp_path):
    """Run prepare on sources; return (counts, conversations, quarantine) read back from the outputs."""

    def _run(sources, **kwargs):
        out = tmp_path / "out"
        counts = calls.prepare(
            [str(s) for s in sources],
            out / "conversations.jsonl",
            out / "quarantine.jsonl",
            out / "counts.json",
            **kwargs,
        )
        assert json.loads((out / "counts.json").read_text()) == counts
        check_invariant(counts)
        for c in [*counts["files"], counts["totals"]]:
            assert c["rows_in"] == c["kept"] + c["duplicates"] + sum(c["quarantined"].values())
        return counts, read_jsonl(out / "conversations.jsonl"), read_jsonl(out / "quarantine.jsonl")

    return _run


# ------------------------------------------------------------------------------------ normalization


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("human", "user"),
        ("User", "user"),
        ("GPT", "assistant"),
        ("assistant", "assistant"),
        ("ChatGPT", "assistant"),
        ("bing", "assistant"),
        ("bard", "assistant"),
        ("model", "assistant"),
    ],
)
def test_role_map(raw, expected):
    other = {"role": "user", "content": "q"} if expected == "assistant" else {"role": "assistant", "content": "a"}
    messages = normalize({"messages": [{"role": raw, "content": "x"}, other]}, allow_no_user_turn=False)
    assert messages[0] == {"role": expected, "content": "x"}


def test_sharegpt_and_openai_normalize_to_the_same_messages_and_id():
    a, b = (
        normalize(sharegpt(system="be brief"), allow_no_user_turn=False),
        normalize(openai(system="be brief"), allow_no_user_turn=False),
    )
    assert (
        a
        == b
        == [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
    )
    assert conversation_id(a) == conversation_id(b)
    assert len(conversation_id(a)) == 64


def test_content_is_kept_verbatim_and_text_parts_are_joined():
    messages = normalize(
        {
            "conversations": [  # {role, content} inside "conversations" is accepted too
                {"role": "user", "content": [{"type": "text", "text": "  a"}, {"type": "text", "text": "b\n"}]},
                {"from": "gpt", "value": "\n answer \n"},
            ]
        },
        allow_no_user_turn=False,
    )
    assert messages == [{"role": "user", "content": "  ab\n"}, {"role": "assistant", "content": "\n answer \n"}]


def test_extra_keys_are_dropped_and_none_keys_ignored():
    record = {"messages": [{"role": "user", "content": "q", "name": "x"}, {"role": "assistant", "content": "a"}]}
    record["conversations"] = None  # parquet fills absent columns with null
    assert normalize(record, allow_no_user_turn=False) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]


def _user(content):
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "a"}]}


BAD_RECORDS = {
    "unknown_shape": [
        ["not", "an", "object"],
        {"text": "hello"},
        {"messages": "a string"},
        {"messages": [openai()["messages"][0]], "conversations": sharegpt()["conversations"]},
        {"messages": ["hi", {"role": "assistant", "content": "a"}]},
    ],
    "missing_role": [{"messages": [{"content": "q"}, {"role": "assistant", "content": "a"}]}],
    "unknown_role": [
        {"messages": [{"role": "user", "content": "q"}, {"role": "critic", "content": "a"}]},
        {"messages": [{"role": 3, "content": "q"}, {"role": "assistant", "content": "a"}]},
    ],
    "invalid_tool_call": [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{not json"}]},
    ],
    "empty_content": [
        _user(""),
        _user("  \n"),
        _user(None),
        _user([]),
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]},
    ],
    "non_string_content": [_user(42), _user({"text": "x"}), _user([{"type": "text", "text": 1}])],
    "non_text_content": [
        _user([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]),
        _user(["bare string part"]),
    ],
    "misplaced_system": [
        {"messages": [*openai()["messages"], {"role": "system", "content": "late"}]},
        {"messages": [{"role": "system", "content": "a"}, *openai(system="b")["messages"]]},
    ],
    "no_assistant_turn": [{"messages": [{"role": "user", "content": "q"}]}, {"messages": []}],
    "no_user_turn": [
        {"messages": [{"role": "assistant", "content": "I start."}]},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "gpt", "value": "I start."}]},
    ],
}


@pytest.mark.parametrize(("reason", "record"), [(r, rec) for r, recs in BAD_RECORDS.items() for rec in recs])
def test_normalize_rejects_with_reason(reason, record):
    with pytest.raises(Rejected) as e:
        normalize(record, allow_no_user_turn=False)
    assert e.value.reason == reason
    assert e.value.detail


def test_unknown_role_detail_names_role_and_index():
    with pytest.raises(Rejected, match=r"messages\[1\].*'critic'"):
        normalize(
            {"messages": [{"role": "user", "content": "q"}, {"role": "critic", "content": "a"}]},
            allow_no_user_turn=False,
        )


WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def test_openai_tool_calls_and_tool_replies_are_kept_not_quarantined_as_empty_content():
    messages = normalize(
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", **WEATHER_CALL, "function": {**WEATHER_CALL["function"],
                                                                           "arguments": '{"city": "Paris"}'}}],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "assistant", "content": "Sunny.", "function_call": None},
            ]
        }, allow_no_user_turn=False
    )  # fmt: skip
    assert messages == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{**WEATHER_CALL, "id": "c1"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Sunny."},
    ]


def test_sharegpt_function_call_and_observation_turns_match_the_openai_shape():
    sharegpt_record = {
        "conversations": [
            {"from": "human", "value": "Weather?"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
            {"from": "observation", "value": "sunny"},
            {"from": "gpt", "value": "Sunny."},
        ],
        "tools": '[{"name": "get_weather", "parameters": {}}]',
    }
    assert normalize(sharegpt_record, allow_no_user_turn=False) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    assert normalize_tools(sharegpt_record) == [{"name": "get_weather", "parameters": {}}]
    with pytest.raises(Rejected, match="tools is not valid JSON"):
        normalize_tools({**sharegpt_record, "tools": "[oops"})
    # The tools are part of the conversation's identity; a record without tools keeps its old id.
    plain = normalize(openai(), allow_no_user_turn=False)
    assert conversation_id(plain, None) == conversation_id(plain) != conversation_id(plain, [{"name": "x"}])


# An assistant turn that answers nobody (issue #24): prepare kept it, and tokenize made it a training row.
GREETING_FIRST = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Hello! Ask me anything."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hi."},
    ]
}
TOOLS_ONLY = {
    "messages": [
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
}


def test_a_conversation_without_a_user_turn_is_quarantined_as_no_user_turn(tmp_path, run):
    rows = [openai(), *BAD_RECORDS["no_user_turn"], TOOLS_ONLY, GREETING_FIRST]
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    counts, convs, quar = run([src])
    assert [(q["line"], q["reason"]) for q in quar] == [(2, "no_user_turn"), (3, "no_user_turn"), (4, "no_user_turn")]
    assert quar[0]["detail"] == (
        "none of the 1 messages is from the user (roles: assistant); "
        "set data.allow_no_user_turn: true if the dataset is completion-style"
    )
    assert quar[1]["detail"].startswith("none of the 2 messages is from the user (roles: assistant, system)")
    # A greeting before the user's first message answers the system prompt, as a served model may: kept.
    assert [c["source"] for c in convs] == [f"{src}:1", f"{src}:5"]
    assert "5 rows in, 2 kept, 0 duplicates, 3 quarantined (no_user_turn 3)" in summarize(counts)


def test_allow_no_user_turn_keeps_completion_style_records_and_nothing_else(tmp_path, run):
    no_assistant = BAD_RECORDS["no_assistant_turn"][0]
    src = write_jsonl(tmp_path / "a.jsonl", [openai(), *BAD_RECORDS["no_user_turn"], no_assistant])
    counts, convs, quar = run([src], allow_no_user_turn=True)
    assert len(convs) == 3 and [(q["line"], q["reason"]) for q in quar] == [(4, "no_assistant_turn")]
    assert convs[1]["messages"] == [{"role": "assistant", "content": "I start."}]
    # Prompt-only records (regenerate on): the regenerate stage quarantines them as no_user_turn itself.
    counts, convs, quar = run([src], allow_prompt_only=True)
    assert len(convs) == 4 and quar == []


# ------------------------------------------------------------------------------------ stage, JSONL


def test_every_reason_lands_in_quarantine_and_counts(tmp_path, run):
    big = json.dumps(openai(answer="x" * 5000))
    rows = [
        openai(),  # line 1 kept
        big,  # 2 line_too_long
        '{"messages": [',  # 3 invalid_json
        "",  # 4 blank, not a row
        *[rec for recs in BAD_RECORDS.values() for rec in recs],
    ]
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    with open(src, "ab") as f:
        f.write(b'{"messages": "\xff\xfe"}\n')  # invalid_utf8, last line
    counts, convs, quar = run([src], max_line_bytes=1024)

    n_bad = sum(len(v) for v in BAD_RECORDS.values())
    f = counts["files"][0]
    assert (f["format"], f["rows_in"], f["kept"], f["duplicates"], f["blank_lines"]) == ("jsonl", n_bad + 4, 1, 0, 1)
    expected = {r: len(BAD_RECORDS.get(r, [])) for r in REASONS}
    expected.update(line_too_long=1, invalid_json=1, invalid_utf8=1)
    assert f["quarantined"] == expected
    assert set(f["quarantined"]) == set(REASONS)
    assert counts["totals"]["quarantined"] == expected
    assert counts["totals"]["quarantined_total"] == len(quar) == n_bad + 3

    assert convs == [
        {
            "id": conversation_id(normalize(openai(), allow_no_user_turn=False)),
            "messages": normalize(openai(), allow_no_user_turn=False),
            "source": f"{src}:1",
        }
    ]
    by_line = {q["line"]: q for q in quar}
    assert set(quar[0]) == {"file", "line", "reason", "detail", "record"}
    assert by_line[2]["reason"] == "line_too_long" and "over data.max_line_bytes = 1024" in by_line[2]["detail"]
    assert len(by_line[2]["record"]) == 1024  # only a prefix is kept
    assert by_line[3]["reason"] == "invalid_json" and by_line[3]["record"] == '{"messages": ['
    assert 4 not in by_line  # the blank line
    assert by_line[5]["reason"] == "unknown_shape" and by_line[5]["record"] == ["not", "an", "object"]
    last = quar[-1]
    assert (last["line"], last["reason"], last["file"]) == (n_bad + 5, "invalid_utf8", str(src))
    assert "\\xff" in last["record"]


def test_line_at_the_limit_is_parsed_and_one_byte_more_is_not(tmp_path, run):
    line = json.dumps(openai(answer="x" * 2000))
    limit = len(line.encode())
    src = write_jsonl(tmp_path / "a.jsonl", [line, json.dumps(openai(answer="y" * 2000 + "z"))])
    counts, convs, quar = run([src], max_line_bytes=limit)
    assert len(convs) == 1 and [q["reason"] for q in quar] == ["line_too_long"]
    assert f"line is {limit + 1} bytes" in quar[0]["detail"]


def test_huge_line_is_skipped_without_losing_the_next_line(tmp_path, run):
    src = tmp_path / "a.jsonl"
    with open(src, "w") as f:
        f.write('{"messages": "' + "x" * (3 << 20) + '"}\n')  # 3 MiB, read in 1 MiB chunks
        f.write(json.dumps(openai()))  # last line without a newline
    counts, convs, quar = run([src], max_line_bytes=1024)
    assert [q["line"] for q in quar] == [1] and convs[0]["source"] == f"{src}:2"
    assert f"line is {(3 << 20) + 16} bytes" in quar[0]["detail"]


def test_jsonl_bom_crlf_and_line_numbers(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + json.dumps(openai()).encode() + b"\r\n\r\n" + json.dumps(sharegpt()).encode())
    rows = list(JsonlReader(max_line_bytes=1 << 24).read(str(src)))
    assert [(r.line, r.reason) for r in rows] == [(1, None), (3, None)]


def test_empty_files_are_counted(tmp_path, run):
    paths = [tmp_path / "a.jsonl", tmp_path / "b.json", tmp_path / "c.parquet"]
    for p in paths:
        p.write_bytes(b"")
    counts, convs, quar = run(paths)
    assert [(f["file"], f["rows_in"]) for f in counts["files"]] == [(str(p), 0) for p in paths]
    assert counts["totals"]["files"] == 3 and convs == quar == []
    assert "(empty)" in summarize(counts)


def test_nothing_kept_is_one_line_naming_every_source_and_the_quarantine(tmp_path, run, monkeypatch):
    """What the tokenize job says when prepare kept nothing (tests/test_edge_datasets.py: through the CLI)."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "bad.jsonl", ["{", {"messages": [{"role": "critic", "content": "x"}]}])
    (tmp_path / "blank.jsonl").write_text("\n \n")
    (tmp_path / "none.json").write_text("[]")
    run(["bad.jsonl", "blank.jsonl", "none.json"])
    out = tmp_path / "out"
    with pytest.raises(NoConversationsError) as e:
        require_conversations(out / "counts.json", "q.jsonl")
    assert str(e.value) == (
        "no conversations to tokenize: prepare quarantined all 2 records (invalid_json 1, unknown_role 1) of "
        "bad.jsonl (2 records), blank.jsonl (only 2 blank lines), none.json (empty); "
        "each record and its reason is in q.jsonl"
    )
    names = [f"{i}.jsonl" for i in range(7)]
    for name in names:
        (tmp_path / name).write_text("")
    run(names)
    with pytest.raises(NoConversationsError) as e:
        require_conversations(out / "counts.json", "q.jsonl")
    assert str(e.value) == (
        "no conversations to tokenize: data.sources hold no records: 0.jsonl (empty), 1.jsonl (empty), "
        "2.jsonl (empty), 3.jsonl (empty), 4.jsonl (empty) and 2 more files; "
        "list files that contain conversations in data.sources"
    )
    run([*names, write_jsonl(tmp_path / "one.jsonl", [openai()])])  # one conversation is enough
    require_conversations(out / "counts.json", "q.jsonl")


# --------------------------------------------------------------------------- JSON, parquet, datasets


def test_json_list(tmp_path, run):
    src = tmp_path / "a.json"
    src.write_text(json.dumps([openai(), {"messages": []}, sharegpt(user="other")]))
    counts, convs, quar = run([src])
    assert [c["source"] for c in convs] == [f"{src}:1", f"{src}:3"]
    assert [(q["line"], q["reason"]) for q in quar] == [(2, "no_assistant_turn")]
    assert counts["files"][0]["format"] == "json"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"data": []}', r"a\.json: expected a top-level JSON list .* found an object with keys \[data\]"),
        ('[{"messages": [}]', r"a\.json: invalid JSON at line 1 column 16: Expecting value$"),
        ("[1]\n[2]\n", r"a\.json: invalid JSON at line 2 column 1: Extra data .*named \.jsonl\)$"),
        # json ends this message with "at"; the position is said once ("starting at at column" before)
        ('[{"messages": "hi', r"a\.json: invalid JSON at line 1 column 15: Unterminated string starting there$"),
    ],
)
def test_json_file_errors_are_one_line(tmp_path, text, match):
    src = tmp_path / "a.json"
    src.write_text(text)
    with pytest.raises(InputError, match=match) as e:
        calls.prepare([str(src)], tmp_path / "c.jsonl", tmp_path / "q.jsonl", tmp_path / "n.json")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "c.jsonl").exists()  # nothing half-written


def test_json_invalid_utf8_is_a_file_error(tmp_path):
    src = tmp_path / "a.json"
    src.write_bytes(b'[{"x": "\xff"}]')
    with pytest.raises(InputError, match=r"a\.json: not valid UTF-8 .* at byte 8"):
        calls.prepare([str(src)], tmp_path / "c.jsonl", tmp_path / "q.jsonl", tmp_path / "n.json")


def test_parquet_rows_and_non_json_record(tmp_path, run):
    src = tmp_path / "a.parquet"
    rows = [openai(), openai(user="q2"), {"messages": [{"role": "user", "content": "q"}]}]
    table = pa.Table.from_pylist([{**r, "blob": b"\x00\x01"} for r in rows])
    pq.write_table(table, src, row_group_size=2)
    counts, convs, quar = run([src])
    assert [c["source"] for c in convs] == [f"{src}:1", f"{src}:2"]
    assert [(q["line"], q["reason"]) for q in quar] == [(3, "no_assistant_turn")]
    assert isinstance(quar[0]["record"], str) and "b'\\x00\\x01'" in quar[0]["record"]  # bytes -> repr
    assert counts["files"][0]["format"] == "parquet"


def test_corrupt_parquet_is_a_file_error(tmp_path):
    src = tmp_path / "bad.parquet"
    src.write_bytes(b"this is not parquet at all")
    with pytest.raises(InputError, match=r"bad\.parquet: cannot read as parquet \(") as e:
        calls.prepare([str(src)], tmp_path / "c.jsonl", tmp_path / "q.jsonl", tmp_path / "n.json")
    assert "\n" not in str(e.value)


def test_hf_save_to_disk_folder(tmp_path, run):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "hf"
    datasets.Dataset.from_list(
        [sharegpt(), sharegpt(user="q2"), {"conversations": [{"from": "human", "value": "q"}]}]
    ).save_to_disk(str(folder))
    counts, convs, quar = run([folder])
    assert counts["files"][0]["format"] == "hf_dataset"
    assert [c["source"] for c in convs] == [f"{folder}:1", f"{folder}:2"]
    assert [(q["line"], q["reason"]) for q in quar] == [(3, "no_assistant_turn")]


def test_hf_dataset_dict_names_a_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "dd"
    datasets.DatasetDict(train=datasets.Dataset.from_list([sharegpt()])).save_to_disk(str(folder))
    with pytest.raises(InputError, match=r"dd: is a DatasetDict \(splits: train\); .* e\.g\. .*dd/train"):
        calls.prepare([str(folder)], tmp_path / "c.jsonl", tmp_path / "q.jsonl", tmp_path / "n.json")


def test_folder_that_is_not_a_dataset(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("x")
    with pytest.raises(InputError) as e:
        calls.prepare([str(folder)], tmp_path / "c.jsonl", tmp_path / "q.jsonl", tmp_path / "n.json")
    assert str(e.value) == (
        f"{folder}: is a folder but not a Hugging Face dataset saved with save_to_disk "
        "(expected state.json and dataset_info.json in it; found readme.txt)"
    )


# ------------------------------------------------------------------------------- sources, dedup


def test_dedup_across_files_and_shapes(tmp_path, run):
    a = write_jsonl(tmp_path / "a.jsonl", [sharegpt(), sharegpt(user="other"), sharegpt()])
    b = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([openai(), openai(user="new")]), b)
    counts, convs, quar = run([a, b])
    first_id = conversation_id(normalize(openai(), allow_no_user_turn=False))
    assert [c["source"] for c in convs] == [f"{a}:1", f"{a}:2", f"{b}:2"]
    assert len({c["id"] for c in convs}) == 3
    assert [(f["rows_in"], f["kept"], f["duplicates"]) for f in counts["files"]] == [(3, 2, 1), (2, 1, 1)]
    assert counts["duplicate_rows"] == [
        {"file": str(a), "line": 3, "id": first_id},
        {"file": str(b), "line": 1, "id": first_id},
    ]
    assert counts["duplicate_rows_truncated"] is False
    assert counts["totals"] | {"quarantined": None} == {
        "files": 2,
        "rows_in": 5,
        "kept": 3,
        "duplicates": 2,
        "quarantined_total": 0,
        "blank_lines": 0,
        "quarantined": None,
    }
    assert quar == []


def test_globs_are_sorted_and_repeats_read_once(tmp_path, run):
    for name in ("b", "a", "c"):
        write_jsonl(tmp_path / f"{name}.jsonl", [openai(user=name)])
    files = expand_sources([str(tmp_path / "c.jsonl"), str(tmp_path / "*.jsonl")])
    assert files == [str(tmp_path / f"{n}.jsonl") for n in "cab"]
    counts, convs, _ = run([tmp_path / "c.jsonl", tmp_path / "*.jsonl"])
    assert [c["messages"][0]["content"] for c in convs] == ["c", "a", "b"]
    assert counts["sources"] == [str(tmp_path / "c.jsonl"), str(tmp_path / "*.jsonl")]


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("missing.jsonl", r"data\.sources: '.*missing\.jsonl' does not exist"),
        ("nothing-*.jsonl", r"data\.sources: pattern '.*nothing-\*\.jsonl' matches no files"),
    ],
)
def test_missing_sources(tmp_path, name, match):
    with pytest.raises(InputError, match=match):
        calls.prepare(
            [str(tmp_path / name)],
            tmp_path / "c.jsonl",
            tmp_path / "q.jsonl",
            tmp_path / "n.json",
        )


def test_unsupported_extension_fails_before_reading(tmp_path):
    good = write_jsonl(tmp_path / "a.jsonl", [openai()])
    (tmp_path / "b.csv").write_text("x\n")
    with pytest.raises(InputError, match=r"b\.csv: unsupported file type '\.csv' \(expected \.jsonl"):
        calls.prepare(
            [str(good), str(tmp_path / "b.csv")],
            tmp_path / "c.jsonl",
            tmp_path / "q.jsonl",
            tmp_path / "n.json",
        )
    assert not (tmp_path / "c.jsonl").exists()


def test_check_invariant_raises_on_broken_counts(tmp_path, run):
    counts, _, _ = run([write_jsonl(tmp_path / "a.jsonl", [openai(), {"x": 1}])])
    counts["files"][0]["kept"] += 1
    with pytest.raises(RuntimeError, match="row accounting broken for .*a.jsonl"):
        check_invariant(counts)
    counts["files"][0]["kept"] -= 1
    with pytest.raises(RuntimeError, match="lines written"):
        check_invariant(counts, {"conversations": 0, "quarantine": 1})


def job_config(**data):
    """The validated config a prepare job reads its settings from, with `data` as its data section."""
    return validate_config({"data": data, "model": {"path": "model"}})


def test_snakemake_script(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", [openai(), "{"])
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # the script redirects it; restored after the test
    smk = SimpleNamespace(
        input=[str(src)],
        output=SimpleNamespace(
            conversations=str(out / "c.jsonl"), quarantine=str(out / "q.jsonl"), counts=str(out / "n.json")
        ),
        params=SimpleNamespace(sources=[str(src)], max_line_bytes=1 << 20),
        log=[str(tmp_path / "prepare.log")],
        config=job_config(sources=[str(src)], max_line_bytes=1 << 20),
    )
    runpy.run_path(str(ROOT / "scripts" / "prepare.py"), init_globals={"snakemake": smk})
    sys.stderr.close()
    assert len(read_jsonl(out / "c.jsonl")) == 1 and len(read_jsonl(out / "q.jsonl")) == 1
    log = (tmp_path / "prepare.log").read_text()
    assert "2 rows in, 1 kept, 0 duplicates, 1 quarantined (invalid_json 1)" in log


@pytest.mark.parametrize("allow", [None, True], ids=["param_absent", "allow_no_user_turn"])
def test_snakemake_script_passes_allow_no_user_turn(tmp_path, monkeypatch, allow):
    # The rule passes the param only when it is true (rules/prepare.smk): absent means false.
    src = write_jsonl(tmp_path / "a.jsonl", [openai(), BAD_RECORDS["no_user_turn"][0]])
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    params = {"sources": [str(src)], "max_line_bytes": 1 << 20}
    smk = SimpleNamespace(
        input=[str(src)],
        output=SimpleNamespace(
            conversations=str(out / "c.jsonl"), quarantine=str(out / "q.jsonl"), counts=str(out / "n.json")
        ),
        params=SimpleNamespace(**params, **({"allow_no_user_turn": allow} if allow else {})),
        log=[str(tmp_path / "prepare.log")],
        config=job_config(**params, allow_no_user_turn=bool(allow)),
    )
    runpy.run_path(str(ROOT / "scripts" / "prepare.py"), init_globals={"snakemake": smk})
    sys.stderr.close()
    log = (tmp_path / "prepare.log").read_text()
    if allow:
        assert "2 rows in, 2 kept, 0 duplicates, 0 quarantined" in log
    else:
        assert "2 rows in, 1 kept, 0 duplicates, 1 quarantined (no_user_turn 1)" in log


def test_a_jsonl_line_that_does_not_parse_names_its_column_once(tmp_path, run):
    """json ends some messages with "at" ("Unterminated string starting at"): the detail read "at at column"."""
    src = write_jsonl(tmp_path / "a.jsonl", [openai(), '{"messages": "hi', '{"messages": "a\tb"}'])
    _, _, quar = run([src])
    assert [(q["reason"], q["detail"]) for q in quar] == [
        ("invalid_json", "Unterminated string starting at column 14"),
        ("invalid_json", "Invalid control character at column 16"),
    ]


def lossy_sources(tmp_path: Path) -> tuple[Path, Path]:
    """A good JSONL file and a parquet with other column names beside it: every row of the second is quarantined
    (unknown_shape)."""
    good = write_jsonl(tmp_path / "good.jsonl", [openai(user=f"q{i}") for i in range(4)])
    odd = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"dialog": ["hi", "yo", "hey"], "source": ["a", "b", "c"]}), odd)
    return good, odd


def run_prepare_script(tmp_path: Path, script: str, sources: list[Path], max_share=None, **params) -> str:
    """scripts/<script> as Snakemake runs it, on `sources`; returns its log."""
    out, log = tmp_path / "out", tmp_path / "prepare.log"
    smk = SimpleNamespace(
        input=[str(s) for s in sources],
        output=SimpleNamespace(
            conversations=str(out / "c.jsonl"), quarantine=str(out / "q.jsonl"), counts=str(out / "n.json")
        ),
        params=SimpleNamespace(sources=[str(s) for s in sources], max_line_bytes=1 << 20, **params),
        log=[str(log)],
        config=job_config(
            sources=[str(s) for s in sources], max_line_bytes=1 << 20,
            **({"max_quarantine_share": max_share} if max_share is not None else {}),
        ),
    )  # fmt: skip
    try:
        runpy.run_path(str(ROOT / "scripts" / script), init_globals={"snakemake": smk})
    finally:
        sys.stderr.close()
    return log.read_text()


def assert_fails_naming_the_lossy_file(tmp_path: Path, script: str, odd: Path, sources: list[Path], **params) -> None:
    with pytest.raises(SystemExit) as e:
        run_prepare_script(tmp_path, script, sources, **params)
    assert e.value.code == 1
    errors = [line for line in (tmp_path / "prepare.log").read_text().splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {odd}: prepare quarantined 3 of its 3 rows (all; unknown_shape 3), a file that loses every row "
        f"fails whatever data.max_quarantine_share is (now 0.5); each record and its reason is in "
        f"{tmp_path / 'prepare.quarantine.jsonl'}: fix the file or drop it from data.sources"
    ]
    assert len(read_jsonl(tmp_path / "prepare.quarantine.jsonl")) == 3


def test_a_source_file_that_loses_all_or_most_of_its_rows_fails_prepare_in_one_line(tmp_path, monkeypatch):
    """A parquet with other column names beside a good file: every row quarantined (unknown_shape); prepare fails
    naming the file, the reason counts and the setting, and keeps the quarantine beside the log."""
    good, odd = lossy_sources(tmp_path)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    assert_fails_naming_the_lossy_file(tmp_path, "prepare.py", odd, [good, odd])
    # Most but not all rows lost: the share decides; at 1 it passes.
    pq.write_table(pa.table({"messages": [openai()["messages"], None, None]}), odd)
    with pytest.raises(SystemExit):
        run_prepare_script(tmp_path, "prepare.py", [good, odd])
    assert "quarantined 2 of its 3 rows (67%;" in (tmp_path / "prepare.log").read_text()
    assert "error:" not in run_prepare_script(tmp_path, "prepare.py", [good, odd], max_share=1)
    assert "or raise data.max_quarantine_share" in loss_error(
        json.loads((tmp_path / "out/n.json").read_text()), 0.5, "q.jsonl"
    )


def test_a_file_that_loses_every_row_is_never_told_to_raise_the_share(tmp_path, monkeypatch):
    """At data.max_quarantine_share = 1 a file with every row quarantined still fails: the line says so, and does
    not send the user to raise a share that is already 1 (before: "... or raise data.max_quarantine_share")."""
    good, odd = lossy_sources(tmp_path)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    with pytest.raises(SystemExit):
        run_prepare_script(tmp_path, "prepare.py", [good, odd], max_share=1)
    error = [x for x in (tmp_path / "prepare.log").read_text().splitlines() if x.startswith("error: ")][-1]
    assert "quarantined 3 of its 3 rows (all; unknown_shape 3), a file that loses every row fails whatever " in error
    assert "data.max_quarantine_share is (now 1)" in error and error.endswith(
        "fix the file or drop it from data.sources"
    )
    assert "raise" not in error


@pytest.mark.parametrize("text,what", [("", "an empty file"), ("\n\n", "only 2 blank lines")])
def test_an_empty_source_file_beside_good_ones_is_an_error_naming_it(tmp_path, monkeypatch, text, what):
    """Before: `empty.jsonl: 0 rows in, 0 kept`, and the run went on without the file in silence."""
    good, _ = lossy_sources(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(text)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    with pytest.raises(SystemExit) as e:
        run_prepare_script(tmp_path, "prepare.py", [good, empty])
    assert e.value.code == 1
    errors = [x for x in (tmp_path / "prepare.log").read_text().splitlines() if x.startswith("error: ")]
    assert errors == [
        f"error: {empty}: no records ({what}); a source file must hold conversations: fix the file or drop it "
        "from data.sources"
    ]


def test_the_regenerate_stages_prompt_only_prepare_applies_the_loss_share_too(tmp_path, monkeypatch):
    """regenerate.enabled runs scripts/prepare_prompt_only.py: a file whose rows are all quarantined fails it in the
    same one line as prepare's (before: the run went on without the file, exit 0)."""
    good, odd = lossy_sources(tmp_path)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    kw = {"allow_prompt_only": True}
    assert_fails_naming_the_lossy_file(tmp_path, "prepare_prompt_only.py", odd, [good, odd], **kw)
    # Prompts without a reply are kept here (the target writes them): they are no loss.
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hi"}]] * 3}), odd)
    assert "error:" not in run_prepare_script(tmp_path, "prepare_prompt_only.py", [good, odd], **kw)
