"""Tests of eagle3prep.tokenize: loss masks, quarantine, truncation, shards, stats, template errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from eagle3prep.infra.atomic import sha256_file
from eagle3prep.infra.provenance import tokenizer_identity
from eagle3prep.records import Conversation, TokenizedRow
from eagle3prep.tokenize import (
    ChatEncoder,
    Rejected,
    TokenizeError,
    copy_lines,
    mask_runs,
    row_json_tail,
    shard_ranges,
    tool_probe,
)

from testkit import calls

SYSTEM = {"role": "system", "content": "You are a patient teacher."}


def conv(*pairs: tuple[str, str], system: bool = False) -> list[dict[str, str]]:
    """Messages from (user, assistant) pairs; an assistant of None leaves the turn out."""
    messages = [dict(SYSTEM)] if system else []
    for user, assistant in pairs:
        messages.append({"role": "user", "content": user})
        if assistant is not None:
            messages.append({"role": "assistant", "content": assistant})
    return messages


def write_conversations(path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, messages in enumerate(conversations):
            cid = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
            f.write(json.dumps(Conversation(cid, messages, f"test:{i + 1}").to_json()) + "\n")
    return path


def run(tmp_path: Path, model_dir: Path, conversations, *, shards: int = 2, max_seq_len: int = 256, **kw):
    """Tokenize `conversations`; return (rows of all shards in order, per-shard rows, stats, quarantine, freq)."""
    src = write_conversations(tmp_path / "conversations.jsonl", conversations)
    out = tmp_path / "tokenized"
    shard_paths = [out / f"shard_{k}.jsonl" for k in range(shards)]
    stats = calls.tokenize(
        src,
        model_dir,
        shard_paths,
        out / "stats.json",
        out / "token_freq.json",
        out / "quarantine.jsonl",
        max_seq_len,
        **kw,
    )
    per_shard = [[json.loads(line) for line in p.read_text().splitlines()] for p in shard_paths]
    quarantine = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    freq = json.loads((out / "token_freq.json").read_text())
    assert json.loads((out / "stats.json").read_text()) == stats
    return [r for rows in per_shard for r in rows], per_shard, stats, quarantine, freq


def tokenizer_variant(tmp_path: Path, demo_model_dir: Path, template: str | None) -> Path:
    """A tokenizer-only model folder: the demo tokenizer with `template` as its chat template (None = none)."""
    folder = tmp_path / "variant"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / name, folder / name)
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


def demo_template(demo_model_dir: Path) -> str:
    return (demo_model_dir / "chat_template.jinja").read_text()


def strip_markers(template: str) -> str:
    return template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")


def masked_runs(row: dict) -> list[list[int]]:
    """Token ids of each maximal run of loss_mask == 1."""
    runs, current = [], []
    for token, m in zip(row["input_ids"], row["loss_mask"], strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


MIXED = [
    conv(("How do I fix a chain?", "Clean it, then oil it.")),
    conv(("Why is the sky blue?", "Light scatters."), ("And at night?", "There is no sunlight."), system=True),
    conv(("Tell me about owls.", " They hunt at night.\n\nQuietly. "), ("More?", "1. Big eyes\n2. Soft wings")),
    [
        {"role": "assistant", "content": "I speak first."},
        {"role": "user", "content": "Fine."},
        {"role": "assistant", "content": "Thanks."},
    ],  # fmt: skip
    conv(
        ("Numbers: 12345, 3.14?", "Yes: 42 and 7."), ("Unicode?", "Café, naïve, 東京 ✓"), ("Ok", "Done."), system=True
    ),
]


def test_mask_is_exactly_the_assistant_turns(tmp_path, demo_model_dir, tokenizer):
    rows, _, stats, quarantine, _ = run(tmp_path, demo_model_dir, MIXED)
    assert quarantine == [] and stats["mask_source"] == "generation_markers"
    for row, messages in zip(rows, MIXED, strict=True):
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        # one masked run per assistant turn, decoding to its content and end-of-turn token, nothing else
        assert [tokenizer.decode(run) for run in masked_runs(row)] == replies
        unmasked = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m])
        for m in messages:
            if m["role"] != "assistant":
                assert m["content"] in unmasked  # system and user text are never trained on


def test_system_prompt_is_masked_zero(tmp_path, demo_model_dir, tokenizer):
    rows, *_ = run(tmp_path, demo_model_dir, [conv(("Hi?", "Hello."), system=True)])
    text = tokenizer.apply_chat_template([SYSTEM], tokenize=False)
    n_system = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert rows[0]["input_ids"][:n_system] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert rows[0]["loss_mask"][:n_system] == [0] * n_system


def test_render_boundary_fallback_matches_generation_markers(tmp_path, demo_model_dir):
    plain = tokenizer_variant(tmp_path, demo_model_dir, strip_markers(demo_template(demo_model_dir)))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    marked_rows, _, marked_stats, *_ = run(tmp_path / "a", demo_model_dir, MIXED)
    plain_rows, _, plain_stats, *_ = run(tmp_path / "b", plain, MIXED)
    assert marked_stats["mask_source"] == "generation_markers"
    assert plain_stats["mask_source"] == "render_boundary"
    assert plain_rows == marked_rows
    assert plain_stats["chat_template_sha256"] != marked_stats["chat_template_sha256"]


def test_no_assistant_tokens_is_quarantined(tmp_path, demo_model_dir):
    long_prompt = "Please read this. " + "The harbour and the bridge are old. " * 40
    conversations = [
        conv(("Hi?", "Hello.")),
        conv(("Is anyone there?", None)),  # no assistant turn at all
        conv((long_prompt, "Nice notes.")),  # the reply falls past max_seq_len
        conv(("Bye?", "Bye.")),
    ]
    rows, _, stats, quarantine, _ = run(tmp_path, demo_model_dir, conversations, max_seq_len=64)
    assert [(q["line"], q["reason"]) for q in quarantine] == [(2, "no_assistant_tokens"), (3, "no_assistant_tokens")]
    assert "within the first 64" in quarantine[1]["detail"]
    assert quarantine[0]["record"]["messages"] == conversations[1]
    assert quarantine[0]["file"].endswith("conversations.jsonl")
    assert stats["quarantined"] == {"no_assistant_tokens": 2}
    assert stats["conversations_in"] == len(conversations) == stats["rows"] + stats["quarantined_total"]
    assert [r["row"] for r in rows] == [0, 1]  # row ids stay dense after a quarantine
    assert stats["truncated_rows"] == 0  # the truncated row was quarantined, not kept


def test_every_conversation_quarantined_is_one_line_error_not_an_empty_dataset(tmp_path, demo_model_dir):
    long_prompt = "Please read this. " + "The harbour and the bridge are old. " * 40
    conversations = [conv((long_prompt, "Nice notes.")), conv(("Is anyone there?", None))]
    with pytest.raises(TokenizeError) as e:
        run(tmp_path, demo_model_dir, conversations, max_seq_len=64)
    message = str(e.value)
    assert "\n" not in message
    assert "all 2 conversations were quarantined (no_assistant_tokens 2)" in message
    # the raw record's file:line (prepare's `source`), then where it sits in the prepared file
    assert "e.g. test:1 (" in message
    assert "conversations.jsonl line 1): no_assistant_tokens: no assistant token within the first 64" in message
    assert "raise tokenize.max_seq_len (64)" in message


def test_truncation(tmp_path, demo_model_dir):
    long_reply = "The comet crosses the orbit of the moon. " * 30
    rows, _, stats, *_ = run(
        tmp_path, demo_model_dir, [conv(("Tell me a lot.", long_reply)), conv(("Hi", "Yo"))], max_seq_len=48
    )
    assert rows[0]["seq_len"] == len(rows[0]["input_ids"]) == len(rows[0]["loss_mask"]) == 48
    assert rows[0]["loss_mask"][-1] == 1
    assert rows[1]["seq_len"] < 48
    assert stats["truncated_rows"] == 1
    (tmp_path / "full").mkdir()
    full = run(tmp_path / "full", demo_model_dir, [conv(("Tell me a lot.", long_reply))], max_seq_len=1024)[0][0]
    assert stats["truncated_tokens"] == full["seq_len"] - 48 > 0  # what training loses, for the report
    assert stats["seq_len"]["max"] == 48


def test_shards_are_contiguous_row_ranges(tmp_path, demo_model_dir):
    conversations = [conv((f"Question {i}?", f"Answer {i}.")) for i in range(7)]
    rows, per_shard, stats, _, _ = run(tmp_path, demo_model_dir, conversations, shards=3)
    assert [len(s) for s in per_shard] == [3, 2, 2]
    assert [r["row"] for r in rows] == list(range(7))
    ids = [json.loads(line)["id"] for line in (tmp_path / "conversations.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ids  # input order
    assert [(s["first_row"], s["rows"]) for s in stats["shards"]] == [(0, 3), (3, 2), (5, 2)]
    assert [s["tokens"] for s in stats["shards"]] == [sum(r["seq_len"] for r in s) for s in per_shard]
    assert sum(s["tokens"] for s in stats["shards"]) == stats["tokens"]


def test_more_shards_than_rows_writes_empty_shards(tmp_path, demo_model_dir):
    rows, per_shard, stats, _, _ = run(tmp_path, demo_model_dir, [conv(("a?", "b.")), conv(("c?", "d."))], shards=4)
    assert [len(s) for s in per_shard] == [1, 1, 0, 0]
    assert all((tmp_path / "tokenized" / f"shard_{k}.jsonl").exists() for k in range(4))
    assert not [p.name for p in (tmp_path / "tokenized").iterdir() if p.name.startswith(".tmp-")]


def test_shard_ranges():
    assert shard_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert shard_ranges(0, 2) == [(0, 0), (0, 0)]
    assert shard_ranges(5, 1) == [(0, 5)]


def test_stats_and_token_freq(tmp_path, demo_model_dir):
    rows, _, stats, _, freq = run(tmp_path, demo_model_dir, MIXED)
    expected = Counter(t for r in rows for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m)
    assert {int(k): v for k, v in freq.items()} == expected  # speculators' token_freq: loss-masked tokens only
    assert stats["assistant_tokens"] == sum(expected.values())
    assert stats["tokens"] == sum(r["seq_len"] for r in rows)
    assert stats["tokenizer_sha256"] == sha256_file(demo_model_dir / "tokenizer.json")
    assert stats["chat_template_sha256"] == tokenizer_identity(str(demo_model_dir))["chat_template_sha256"]
    lens = sorted(r["seq_len"] for r in rows)
    assert (stats["seq_len"]["min"], stats["seq_len"]["max"]) == (lens[0], lens[-1])
    assert stats["seq_len"]["p50"] == lens[2]


def test_no_chat_template_names_the_folder(tmp_path, demo_model_dir):
    folder = tokenizer_variant(tmp_path, demo_model_dir, None)
    with pytest.raises(ValueError, match=f"{folder}: the tokenizer has no usable chat template"):
        run(tmp_path, folder, MIXED)


def test_no_markers_without_fallback_is_an_error(tmp_path, demo_model_dir):
    folder = tokenizer_variant(tmp_path, demo_model_dir, strip_markers(demo_template(demo_model_dir)))
    with pytest.raises(ValueError, match="no \\{% generation %\\} markers and tokenize.template_fallback is false"):
        run(tmp_path, folder, MIXED, template_fallback=False)


def test_template_where_no_method_works_is_an_error(tmp_path, demo_model_dir):
    # the generation prompt says "assistant" but the turn is rendered as "bot": no prefix relation at all
    branch = "{%- if message['role'] == 'assistant' -%}{{- '<|im_start|>"
    template = strip_markers(demo_template(demo_model_dir)).replace(branch + "assistant", branch + "bot")
    assert "bot" in template
    folder = tokenizer_variant(tmp_path, demo_model_dir, template)
    with pytest.raises(ValueError, match=f"{folder}: cannot derive the loss mask"):
        run(tmp_path, folder, MIXED)


def test_unstable_template_quarantines_multi_turn_rows(tmp_path, demo_model_dir):
    # An earlier assistant turn renders differently once a later turn follows (as templates that drop
    # past reasoning do): single-turn rows are fine, multi-turn rows cannot be masked safely.
    template = strip_markers(demo_template(demo_model_dir)).replace(
        "{{- message['content'] + '<|im_end|>' -}}",
        "{{- message['content'] + ('!' if loop.last else '') + '<|im_end|>' -}}",
    )
    folder = tokenizer_variant(tmp_path, demo_model_dir, template)
    conversations = [conv(("One?", "Yes.")), conv(("One?", "Yes."), ("Two?", "No."))]
    rows, _, stats, quarantine, _ = run(tmp_path, folder, conversations)
    assert len(rows) == 1
    assert [(q["line"], q["reason"]) for q in quarantine] == [(2, "template_not_prefix_stable")]
    assert stats["quarantined"] == {"template_not_prefix_stable": 1}


def test_template_exception_quarantines_only_that_row(tmp_path, demo_model_dir):
    template = (
        "{%- if messages[0]['role'] == 'system' -%}{{- raise_exception('System role not supported') -}}{%- endif -%}"
        + demo_template(demo_model_dir)
    )
    folder = tokenizer_variant(tmp_path, demo_model_dir, template)
    rows, _, stats, quarantine, _ = run(tmp_path, folder, MIXED)
    assert [q["line"] for q in quarantine] == [2, 5]  # the two conversations with a system prompt
    assert {q["reason"] for q in quarantine} == {"template_error"}
    assert "System role not supported" in quarantine[0]["detail"]
    assert len(rows) == 3


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_input_line_names_file_and_line(tmp_path, demo_model_dir, workers):
    src = write_conversations(tmp_path / "conversations.jsonl", MIXED[:2])
    with open(src, "a") as f:
        f.write('{"id": "x", "messages": "not a list"}\n')
    with pytest.raises(ValueError, match=r"conversations.jsonl:3: not a normalized conversation"):
        calls.tokenize(
            src,
            demo_model_dir,
            [tmp_path / "s.jsonl"],
            tmp_path / "st.json",
            tmp_path / "f.json",
            tmp_path / "q.jsonl",
            64,
            workers=workers,
            batch_size=2,
        )
    assert not (tmp_path / "s.jsonl").exists()


def test_worker_processes_give_identical_output(tmp_path, demo_model_dir):
    convs = [conv(("user", f"Question {i}?"), ("assistant", f"Answer number {i}.")) for i in range(40)]
    convs[7] = [{"role": "user", "content": "no reply"}]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = run(tmp_path / "one", demo_model_dir, convs, batch_size=4)
    two = run(tmp_path / "two", demo_model_dir, convs, batch_size=4, workers=2)
    assert one[0] == two[0] and one[3][0]["line"] == two[3][0]["line"] == 8
    assert one[2]["rows"] == two[2]["rows"] == 39


# A process whose torch OpenMP team has run (the validation matrix builds the tiny Qwen2.5-VL, then tokenizes its
# image rows) forks the workers; each runs torch ops, as torchvision's image processors do.
FORKED_AFTER_TORCH = """
import torch
from eagle3prep.tokenize import workers
torch.set_num_threads(2)
torch.ones(1 << 20).mul(2).sum()
workers.load_tokenizer = workers.ChatEncoder = lambda *a: None
workers.encode_lines = lambda encoder, path, lines, n: float(torch.ones(1 << 20).mul(2).sum())
print(list(workers.encode_chunks(iter([[(1, "a")], [(2, "b")]]), None, "c.jsonl", 8, 2, (None, False, False, {}))))
"""


def test_workers_forked_after_torch_ran_its_threads_finish():
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), *sys.path])}
    proc = subprocess.Popen([sys.executable, "-c", FORKED_AFTER_TORCH], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the hung workers too (they keep the pipes open)
        proc.communicate()
        pytest.fail("a tokenize worker hung in torch's OpenMP parallel region (forked after the parent's ran)")
    assert proc.returncode == 0, err
    assert out.strip() == "[2097152.0, 2097152.0]"


EDGES = MIXED + [
    conv(("  Leading and trailing spaces  ", "  Reply with spaces around.  ")),
    conv(("Tabs\tand\nnewlines", "\n\nStarts with blank lines")),
    conv(("Special token text?", "Literally <|im_end|> inside a reply.")),
]


def test_encoder_matches_apply_chat_template_row_by_row(tmp_path, demo_model_dir, tokenizer):
    # The batched encoder must give what the one-row-at-a-time transformers call gives, for both
    # mask sources (the render boundary is checked against the markers' mask).
    plain = tokenizer_variant(tmp_path, demo_model_dir, strip_markers(demo_template(demo_model_dir)))
    from transformers import AutoTokenizer

    marked = ChatEncoder(
        AutoTokenizer.from_pretrained(demo_model_dir), demo_model_dir, template_fallback=True, chat_template_kwargs={}
    ).encode(EDGES)
    boundary = ChatEncoder(
        AutoTokenizer.from_pretrained(plain), plain, template_fallback=True, chat_template_kwargs={}
    ).encode(EDGES)
    for messages, m, b in zip(EDGES, marked, boundary, strict=True):
        ref = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert (m[0], list(m[1])) == (ref["input_ids"], ref["assistant_masks"])
        assert (b[0], list(b[1])) == (ref["input_ids"], ref["assistant_masks"])


def test_row_json_tail_is_the_tokenized_row_json():
    id_str = [str(i) for i in range(200_000)]
    for row, cid, ids, mask in [
        (0, "ab12", [1, 2, 3], [0, 1, 1]),
        (12345, 'Café "東京"\n', [151_643, 0], [1, 0]),
        (7, "runs", [5, 6, 7, 8, 9, 10, 11], [1, 0, 0, 1, 1, 0, 1]),
    ]:
        expected = json.dumps(
            TokenizedRow(row=row, id=cid, input_ids=ids, loss_mask=mask, seq_len=len(ids)).to_json(),
            ensure_ascii=False,
            separators=(",", ":"),
        )
        runs = mask_runs(bytearray(mask))
        assert f'{{"row":{row},' + row_json_tail(cid, ids, runs, id_str) == expected + "\n"


def test_mask_runs():
    assert mask_runs(bytearray([0, 1, 1, 0, 0, 1, 0, 1])) == [(1, 3), (5, 6), (7, 8)]
    assert mask_runs(bytearray([1, 1])) == [(0, 2)]
    assert mask_runs(bytearray([0, 0])) == mask_runs(bytearray()) == []


@pytest.mark.parametrize("block", [1, 5, 7, 1 << 20])
def test_copy_lines_splits_at_line_ends_across_blocks(block):
    import io

    lines = [b"%d%s\n" % (i, b"x" * (i % 9)) for i in range(30)]
    src = io.BytesIO(b"".join(lines))
    counts = [0, 4, 1, 0, 13, 12]
    for k, n in enumerate(counts):
        dst = io.BytesIO()
        copy_lines(src, dst, n, block=block)
        first = sum(counts[:k])
        assert dst.getvalue() == b"".join(lines[first : first + n])
    with pytest.raises(EOFError):
        copy_lines(src, io.BytesIO(), 1, block=block)


# ------------------------------------------------------------------------------------------ tool calling

# ChatML that renders tools the way agentic templates do: the schemas in a system block, each call as
# <tool_call>name {arguments}</tool_call> inside the assistant turn, each reply as a `tool` turn.
TOOLS_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\\nTools:' -}}"
    "{%- for t in tools -%}{{- ' ' + t['function']['name'] -}}{%- endfor -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}{%- generation -%}{{- message['content'] -}}"
    "{%- if message.tool_calls is defined -%}{%- for c in message.tool_calls -%}"
    "{{- '<tool_call>' + c['function']['name'] + ' ' + (c['function']['arguments'] | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}{{- '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
# OpenAI's shape as a dataset holds it (arguments as JSON text, content null on the calling turn).
AGENTIC_RECORD = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny in Paris."},
    ],
    "tools": WEATHER_TOOLS,
}


def prepared_agentic(tmp_path: Path) -> Path:
    """The record above through the prepare stage (it was quarantined there as empty_content)."""
    src = tmp_path / "agentic.jsonl"
    src.write_text(json.dumps(AGENTIC_RECORD) + "\n" + json.dumps({"messages": conv(("Hi", "Hello."))}) + "\n")
    counts = calls.prepare([str(src)], tmp_path / "conv.jsonl", tmp_path / "q.jsonl", tmp_path / "counts.json")
    assert counts["totals"]["kept"] == 2
    return tmp_path / "conv.jsonl"


def tokenize_prepared(tmp_path: Path, model: Path, conversations: Path, **kw):
    out = tmp_path / "tokenized"
    stats = calls.tokenize(
        conversations,
        model,
        [out / "shard_0.jsonl"],
        out / "stats.json",
        out / "freq.json",
        out / "q.jsonl",
        512,
        **kw,
    )
    rows = [json.loads(line) for line in (out / "shard_0.jsonl").read_text().splitlines()]
    quarantine = [json.loads(line) for line in (out / "q.jsonl").read_text().splitlines()]
    return stats, rows, quarantine


@pytest.mark.parametrize("markers", [True, False], ids=["generation_markers", "render_boundary"])
def test_tool_turns_are_kept_and_the_mask_covers_the_calls_not_the_results(tmp_path, demo_model_dir, markers):
    from transformers import AutoTokenizer

    template = TOOLS_TEMPLATE if markers else strip_markers(TOOLS_TEMPLATE)
    model = tokenizer_variant(tmp_path, demo_model_dir, template)
    stats, rows, quarantine = tokenize_prepared(tmp_path, model, prepared_agentic(tmp_path))
    assert quarantine == [] and stats["rows"] == 2
    tok = AutoTokenizer.from_pretrained(model)
    masked = [tok.decode(run) for run in masked_runs(rows[0])]
    assert masked == [
        '<tool_call>get_weather {"city": "Paris"}</tool_call><|im_end|>',
        "It is sunny in Paris.<|im_end|>",
    ]
    text = tok.decode(rows[0]["input_ids"])
    assert "Tools: get_weather" in text and "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text  # rendered, not masked


def test_a_template_that_cannot_render_tools_quarantines_with_a_reason_naming_tool_turns(tmp_path, demo_model_dir):
    # The demo template renders message['content'] only: the call would vanish from the hidden states.
    stats, rows, quarantine = tokenize_prepared(tmp_path, demo_model_dir, prepared_agentic(tmp_path))
    assert stats["rows"] == 1 and stats["quarantined"] == {"tool_turns_unsupported_by_template": 1}
    assert quarantine[0]["reason"] == "tool_turns_unsupported_by_template"
    assert quarantine[0]["detail"] == (
        "the chat template does not render tool turns: messages[1] calls 'get_weather', "
        "but the call's name is not in the rendered text"
    )


# Issue #24: whether the template rendered a call was a substring test, and a call named `w` "was rendered" since
# `w` occurs in "weather". The user's question below holds every name tried, the argument's name and the tool
# reply, so a substring test finds them all whatever the template drops; only the render itself can tell.
TOOL_NAMES = ["w", "f", "run", "search", "get_weather"]
QUESTION = "Can you search the weather for my city and run the numbers? I heard: sunny, 21 C."


def call_conversation(name: str) -> tuple[list[dict], list[dict]]:
    """A user question, a call of tool `name` (as prepare normalizes it), the tool's reply, the answer; its tools."""
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": {"city": "Paris"}}}
        ]},
        {"role": "tool", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny in Paris."},
    ]  # fmt: skip
    return messages, [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]


def without(template: str, part: str, instead: str = "") -> str:
    assert part in template
    return template.replace(part, instead)


# What each template leaves out, and the quarantine detail that says so (None: the template renders it all).
CALL_TEMPLATES = {
    "renders_calls": (TOOLS_TEMPLATE, None),
    "no_calls": (None, "messages[1] calls {name!r}, but the call's name is not in the rendered text"),
    "name_not_arguments": (
        without(TOOLS_TEMPLATE, " + ' ' + (c['function']['arguments'] | tojson)"),
        "messages[1] calls {name!r}, but its argument 'city' is not in the rendered text",
    ),
    "no_tool_replies": (
        without(
            TOOLS_TEMPLATE,
            "{%- else -%}{{- '<|im_start|>' + message['role']",
            "{%- elif message['role'] != 'tool' -%}{{- '<|im_start|>' + message['role']",
        ),
        "the tool reply of messages[2] is not in the rendered text",
    ),
    "no_tool_schemas": (
        without(TOOLS_TEMPLATE, "{{- ' ' + t['function']['name'] -}}"),
        "tool 0 ({name!r}) of the record's tools is not in the rendered text",
    ),
}


@pytest.fixture(scope="module")
def call_encoders(demo_model_dir, tmp_path_factory) -> dict[str, ChatEncoder]:
    """A ChatEncoder per CALL_TEMPLATES entry: the demo tokenizer with that template (None: the demo's own)."""
    from transformers import AutoTokenizer

    encoders = {}
    for key, (template, _) in CALL_TEMPLATES.items():
        folder = demo_model_dir
        if template is not None:
            folder = tokenizer_variant(tmp_path_factory.mktemp(key), demo_model_dir, template)
        encoders[key] = ChatEncoder(
            AutoTokenizer.from_pretrained(folder), folder, template_fallback=True, chat_template_kwargs={}
        )
    return encoders


@pytest.mark.parametrize("name", TOOL_NAMES)
@pytest.mark.parametrize("template", list(CALL_TEMPLATES))
def test_a_tool_call_is_kept_only_when_the_template_renders_its_name_arguments_and_reply(
    call_encoders, tokenizer, template, name
):
    messages, tools = call_conversation(name)
    result = call_encoders[template].encode([messages], [tools])[0]
    detail = CALL_TEMPLATES[template][1]
    if detail is None:
        ids, mask = result
        masked = [tokenizer.decode(r) for r in masked_runs({"input_ids": ids, "loss_mask": mask})]
        call = f'<tool_call>{name} {{"city": "Paris"}}</tool_call><|im_end|>'
        assert masked == [call, "It is sunny in Paris.<|im_end|>"]
    else:
        assert isinstance(result, Rejected), f"kept a row whose template drops part of the call: {result}"
        assert (result.reason, result.detail) == (
            "tool_turns_unsupported_by_template",
            "the chat template does not render tool turns: " + detail.format(name=name),
        )


def test_the_render_check_costs_no_render_for_a_conversation_without_tool_parts(call_encoders, monkeypatch):
    encoder = call_encoders["renders_calls"]
    rendered: list[int] = []
    render = encoder._render

    def counting_render(conversations, *args, **kwargs):
        rendered.append(len(conversations))
        return render(conversations, *args, **kwargs)

    monkeypatch.setattr(encoder, "_render", counting_render)
    plain = conv(("Hi", "Hello."), ("More?", "Yes."))
    encoder.encode([plain, plain])
    assert rendered == []  # generation markers: plain conversations get no apply_chat_template render
    messages, tools = call_conversation("w")
    encoder.encode([messages], [tools])
    assert rendered == [1]  # one render, with sentinels; the mask comes from the marker renderer


def test_tool_probe_sentinels_are_new_words_and_text_arguments_are_probed_whole():
    messages, tools = call_conversation("w")
    messages[0]["content"] += " zqxtoolpart0z"  # the text holds what would be the first sentinel
    messages[1]["tool_calls"][0]["function"]["arguments"] = "not a JSON object"
    probe, probe_tools, parts = tool_probe(messages, tools)
    words = [word for word, _ in parts]
    assert len(set(words)) == len(words) == 4  # the call's name, its arguments, the tool reply, the schema's name
    assert not any(word in json.dumps([messages, tools]) for word in words)
    call = probe[1]["tool_calls"][0]["function"]
    assert (call["name"], call["arguments"], probe[2]["content"], probe_tools[0]["function"]["name"]) == tuple(words)
    assert messages[1]["tool_calls"][0]["function"]["name"] == "w"  # the conversation itself is left as it was


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_a_model_folder_without_tokenizer_files_is_refused_naming_them(tmp_path, demo_model_dir, model_type):
    """A Qwen2 folder of config.json and weights only loaded an empty tokenizer (transformers builds one from
    nothing), then was refused for its chat template; with a template copied in, for its {% generation %} block."""
    from eagle3prep.tokenize import load_tokenizer

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    (folder / "chat_template.jinja").write_text(demo_template(demo_model_dir))
    with pytest.raises(TokenizeError) as e:
        load_tokenizer(folder, trust_remote_code=False)
    text = str(e.value)
    assert text.startswith(f"{folder}: the folder has no tokenizer files (no tokenizer.json, tokenizer.model, ")
    assert "chat template" not in text and "generation" not in text and "\n" not in text


def test_rows_that_end_in_a_user_turn_are_counted(tmp_path, demo_model_dir):
    """Kept (their earlier replies are trained on), but the last user message is context no reply follows:
    stats.json counts them for the report, and a run without them keeps its stats.json keys."""
    trailing = conv(("How do I fix a chain?", "Clean it, then oil it."), ("And the brakes?", None))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    *_, stats, _, _ = run(tmp_path / "a", demo_model_dir, [*MIXED[:3], trailing])
    assert stats["rows"] == 4 and stats["trailing_user_rows"] == 1
    *_, stats, _, _ = run(tmp_path / "b", demo_model_dir, MIXED[:3])
    assert "trailing_user_rows" not in stats


def test_a_tokenizer_of_the_models_own_code_is_not_held_to_the_file_names(tmp_path):
    """Its code may read a vocabulary of any name: only with trust_remote_code does the folder pass unread."""
    from eagle3prep.tokenize.files import missing_tokenizer_files

    config = {"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "x.vocab").write_text("{}")
    assert missing_tokenizer_files(tmp_path, trust_remote_code=True) is None
    assert "the folder has no tokenizer files" in missing_tokenizer_files(tmp_path, trust_remote_code=False)
    (tmp_path / "spiece.model").write_bytes(b"x")  # a SentencePiece vocabulary under its T5 name
    assert missing_tokenizer_files(tmp_path, trust_remote_code=False) is None
