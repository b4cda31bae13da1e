"""The regenerate stage without vLLM: splitting, turn plans, prompts, thinking, finish-reason accounting, the shard
folder and its manifest, merging and the review, with the demo tokenizer and a fake engine.

The fake engine answers each prompt with the canonical token ids of a text chosen by `script(prompt_text)`, and
finishes requests in the reverse order they were added, so results that leave in input order prove the
runner's ordering, not the engine's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3prep.prepare import prepare, require_conversations
from eagle3prep.prepare.errors import NoConversationsError
from eagle3prep.records import Quarantined
from eagle3prep.regenerate import (
    PromptRenderer,
    RegenerateError,
    RegenerateSettings,
    Runner,
    ShardError,
    ShardTally,
    conversation_seed,
    merge_shards,
    merged_counts,
    plan_turns,
    regenerate_shard,
    split_conversations,
)
from eagle3prep.regenerate import thinking as th
from eagle3prep.regenerate.review import review, sample_pairs, side_by_side
from eagle3prep.regenerate.stage import model_len
from eagle3prep.regenerate.turns import assemble, context_before
from eagle3prep.tokenize import ChatEncoder, load_tokenizer

from testkit.regenerate import A1, A2, SYS, U1, U2, FakeEngine, conv, echo

CALL = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}  # fmt: skip
RESULT = {"role": "tool", "content": "42"}


@pytest.fixture(scope="module")
def renderer(demo_model_dir) -> PromptRenderer:
    return PromptRenderer.load(demo_model_dir, trust_remote_code=False, chat_template_kwargs={})


def run(renderer, convs, script=echo, settings=None, plan=None, **engine_kwargs):
    settings = settings or RegenerateSettings.defaults()
    plan = plan or th.ThinkingPlan("auto", "keep", "inline", ("<think>", "</think>"), "test")
    engine = FakeEngine(renderer, script, **engine_kwargs)
    tally = ShardTally("prompts.jsonl")
    runner = Runner(engine, renderer, settings, plan, renderer.stop_token_ids(), 1024, "prepared.jsonl", tally)
    results = list(runner.run([(i + 1, c) for i, c in enumerate(convs)]))
    return results, tally, engine


# ---- turn plans ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "mode", "steps", "replaced"),
    [
        ([SYS, U1, A1, U2, A2], "all", [[SYS, U1], [U2]], 2),
        ([U1, A1, U2], "all", [[U1], [U2]], 1),  # ends with a user message: a reply appended
        ([U1], "all", [[U1]], 0),  # a prompt-only record
        ([U1, U2, A1], "all", [[U1, U2]], 1),  # two user messages, one reply
        ([U1, A1, A2, U2, A2], "all", [[U1], [U2]], 3),  # an assistant block of two is one reply
        ([SYS, A1, U1, A2], "all", [[SYS, A1, U1]], 1),  # a greeting before any user answers nobody: kept
        ([SYS, U1, A1, U2, A2], "last", [[SYS, U1, A1, U2]], 1),
        ([U1, CALL, RESULT, A1], "last", [[U1, CALL, RESULT]], 1),  # tool turns kept as context
        ([U1, A1, U2], "last", [[U1, A1, U2]], 0),
    ],
)
def test_turn_plans(messages, mode, steps, replaced):
    plan = plan_turns(messages, mode)
    assert plan.steps == steps and plan.replaced == replaced
    replies = [{"role": "assistant", "content": f"r{i}"} for i in range(len(steps))]
    assert context_before(plan, replies[:1]) == [*steps[0], replies[0], *(steps[1] if len(steps) > 1 else [])]
    assert assemble(plan, replies) == [m for s, r in zip(steps, replies, strict=True) for m in [*s, r]]


def test_conversations_that_cannot_be_regenerated_say_why():
    assert plan_turns([SYS, A1], "all").reason == "no_user_turn"
    rejected = plan_turns([U1, CALL, RESULT, A1], "all")
    assert rejected.reason == "tool_turns" and "turns: last" in rejected.detail


# ---- prompts ------------------------------------------------------------------------------------------------


def test_prompt_ids_are_the_tokenize_rows_up_to_the_reply(demo_model_dir, renderer):
    """The template is applied exactly as tokenize applies it: the prompt's ids are the tokenized row's ids up to
    the first loss-masked token, and a reply decoded from canonical ids encodes back to the row's reply."""
    encoder = ChatEncoder(
        load_tokenizer(demo_model_dir, trust_remote_code=False),
        demo_model_dir,
        template_fallback=True,
        chat_template_kwargs={},
    )
    for messages in ([U1, A1], [SYS, U1, A1, U2, A2]):
        ids, mask = encoder.encode([messages])[0]
        first = mask.index(1)
        prompt = renderer.prompt(messages[: messages.index(A1)])[1]
        assert prompt == ids[:first]
    assert renderer.stop_token_ids() == [renderer.tokenizer.eos_token_id]  # <|im_end|>, also generation_config's


# ---- thinking -----------------------------------------------------------------------------------------------

MARKS = ("<think>", "</think>")
QWEN3_LIKE = (  # reads reasoning_content and opens the thinking in the generation prompt, as Qwen3's templates do
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' -}}"
    "{%- if m.role == 'assistant' and m.reasoning_content is defined -%}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m.content + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
)
DROPS_THINKING = (  # renders only what follows </think>, as DeepSeek-R1's template does
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] }}<|im_end|>\n"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def _render_with(template: str):
    import jinja2

    env = jinja2.Environment()
    return lambda messages: env.from_string(template).render(messages=messages, add_generation_prompt=False)


def test_batched_reply_texts_are_transformers_decode_and_encode_of_each(renderer):
    """The runner decodes and re-encodes a step's replies in one batch; each text and each id list must be what
    transformers' decode (special tokens kept, no clean-up) and the per-text encode give, special tokens,
    ids that split a multi-byte character, and empty replies included."""
    import random

    tok = renderer.tokenizer
    rnd = random.Random(0)
    batch = [[rnd.randrange(len(tok)) for _ in range(rnd.randint(1, 60))] for _ in range(40)]
    batch += [[], [tok.eos_token_id], renderer.encode("naïve café — ünïcödé"), renderer.encode("ü")[:1]]
    texts = renderer.decode_batch(batch)
    assert texts == [tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) for ids in batch]
    assert renderer.encode_batch(texts) == [renderer.encode(t) for t in texts]
    assert renderer.decode_batch([]) == [] and renderer.encode_batch([]) == []


@pytest.mark.parametrize(
    ("config", "template", "mode", "form"),
    [
        ("auto", QWEN3_LIKE, "keep", "field"),
        ("auto", None, "keep", "inline"),  # the demo template renders content as given
        ("auto", DROPS_THINKING, "strip", "none"),
        ("keep", DROPS_THINKING, "keep", "inline"),
        ("strip", QWEN3_LIKE, "strip", "none"),
    ],
)
def test_thinking_plan_follows_the_template(renderer, config, template, mode, form):
    render = _render_with(template) if template else renderer.render
    plan = th.resolve(config, MARKS, render)
    assert (plan.config, plan.mode, plan.form) == (config, mode, form)
    assert plan.to_json()["markers"] == list(MARKS) and plan.why


def test_thinking_is_split_kept_or_stripped():
    keep_field = th.ThinkingPlan("auto", "keep", "field", MARKS, "")
    keep_inline = th.ThinkingPlan("auto", "keep", "inline", MARKS, "")
    strip = th.ThinkingPlan("strip", "strip", "none", MARKS, "")
    text = "<think>\nWeigh it.\n</think>\n\nThe answer."
    assert th.reply_message(text, "", keep_field)[0] == {
        "role": "assistant", "content": "The answer.", "reasoning_content": "Weigh it.",
    }  # fmt: skip
    assert th.reply_message(text, "", keep_inline)[0]["content"] == text
    assert th.reply_message(text, "", strip)[0] == {"role": "assistant", "content": "The answer."}
    # A prompt that opens the thinking itself: the generated text starts inside it.
    prefill = th.prompt_prefill("<|im_start|>assistant\n<think>\n", MARKS)
    assert prefill == "<think>\n"
    message, split = th.reply_message("Weigh it.\n</think>\n\nThe answer.", prefill, keep_inline)
    assert message["content"] == "<think>\nWeigh it.\n</think>\n\nThe answer." and split.terminated
    assert th.prompt_prefill("<|im_start|>assistant\n", MARKS) == ""
    # Cut inside the thinking: unterminated, no answer; stripped, nothing is left.
    cut = th.split_thinking("<think>\nStill weighing", MARKS)
    assert (cut.thinking, cut.answer, cut.terminated) == ("\nStill weighing", "", False)
    assert th.is_empty(th.reply_message("<think>\nStill weighing", "", strip)[0])
    assert not th.is_empty(th.reply_message("<think>\nStill weighing", "", keep_field)[0])
    assert th.split_thinking("No thinking here.", MARKS).thinking is None


def test_a_reasoning_targets_thinking_is_stored_as_its_template_reads_it(demo_model_dir):
    """A Qwen3-like template (reads reasoning_content, opens the thinking in the generation prompt): auto keeps the
    thinking in reasoning_content, strip drops it, and a reply cut inside its thinking is counted unterminated."""
    import copy

    tokenizer = copy.deepcopy(load_tokenizer(demo_model_dir, trust_remote_code=False))
    tokenizer.chat_template = QWEN3_LIKE
    qwen = PromptRenderer(tokenizer, demo_model_dir, {})

    def think(prompt):  # the prompt ends inside "<think>\n": the reply starts with the thought
        cut = "Long question" in prompt
        return ("Weighing it" if cut else "Weighing it.\n</think>\n\nTwo wheels."), "length" if cut else "stop"

    convs = [conv([U1]), conv([{"role": "user", "content": "Long question?"}], "cut")]
    for config, expected in (
        ("auto", {"role": "assistant", "content": "Two wheels.", "reasoning_content": "Weighing it."}),
        ("strip", {"role": "assistant", "content": "Two wheels."}),
    ):
        plan = th.resolve(config, MARKS, qwen.render)
        results, tally, engine = run(qwen, convs, think, plan=plan)
        assert results[0].messages[-1] == expected
        assert engine.prompts["r0-0-0"].endswith("<|im_start|>assistant\n<think>\n")
        assert (tally.replies["with_thinking"], tally.replies["unterminated_thinking"]) == (2, 1)
    assert results[1].reason == "empty_reply"  # stripped, the cut reply has nothing left (on_empty: quarantine)


# ---- the runner ---------------------------------------------------------------------------------------------


def test_every_user_turn_gets_the_targets_reply_given_its_own_earlier_replies(renderer):
    convs = [conv([SYS, U1, A1, U2, A2], "a"), conv([U1], "b"), conv([U2, A1, U1], "c")]
    results, tally, engine = run(renderer, convs)
    assert [r.regenerated["from"] for r in results] == ["a", "b", "c"]  # input order, whatever the engine's
    first = results[0]
    assert [m["content"] for m in first.messages] == [
        SYS["content"], U1["content"], f"Target on: {U1['content']}", U2["content"], f"Target on: {U2['content']}",
    ]  # fmt: skip
    second_prompt = engine.prompts["r0-0-1"]  # conversation a, reply 1: the target's reply 0 is in its prompt
    assert f"Target on: {U1['content']}" in second_prompt and A1["content"] not in second_prompt
    assert results[1].messages == [U1, {"role": "assistant", "content": f"Target on: {U1['content']}"}]
    assert results[0].regenerated["replies"] == [{"finish_reason": "stop", "tokens": len(renderer.encode(
        f"Target on: {U1['content']}")) + 1}, results[0].regenerated["replies"][1]]  # fmt: skip
    assert tally.rows_in == 3 and tally.kept == 3 and tally.replies["requests"] == 5 == tally.replies["stop"]
    assert tally.replies["retokenized_differently"] == 0  # canonical ids decode and encode back to themselves
    # One seed per conversation, from its id only: the same whatever its place in the data.
    assert {engine.seeds[f"r0-0-{t}"] for t in (0, 1)} == {conversation_seed(0, "a")}
    assert conversation_seed(0, "a") != conversation_seed(1, "a") != conversation_seed(0, "b")


def test_turns_last_keeps_the_history_and_replaces_the_final_reply(renderer):
    [result], _, engine = run(
        renderer, [conv([SYS, U1, A1, U2, A2])], settings=RegenerateSettings.defaults(turns="last")
    )
    assert result.messages[:4] == [SYS, U1, A1, U2] and result.messages[4]["content"] == f"Target on: {U2['content']}"
    assert A1["content"] in engine.prompts["r0-0-0"]


def test_finish_reasons_are_counted_and_kept_or_quarantined_per_the_config(renderer):
    def script(prompt):
        last = prompt.split("<|im_start|>user\n")[-1]
        for word, outcome in (("cut", ("Half a rep", "length")), ("empty", ("", "stop")), ("crash", ("x", "error"))):
            if word in last:
                return outcome
        return echo(prompt)

    messages = {w: [{"role": "user", "content": f"Please {w} this."}] for w in ("cut", "empty", "crash", "fine")}
    convs = [conv(m, w) for w, m in messages.items()] + [conv([SYS, A1], "nouser"), conv([U1, {"role": "user", "content": "refuse me"}], "refused")]  # fmt: skip
    results, tally, _ = run(renderer, convs, script, refuse=["refuse me"])
    got = {r.record["id"] if isinstance(r, Quarantined) else r.regenerated["from"]: r for r in results}
    assert got["cut"].messages[-1]["content"] == "Half a rep"  # on_length: keep (the default)
    assert got["empty"].reason == "empty_reply" and got["crash"].reason == "engine_error"
    assert "finish_reason error: boom" in got["crash"].detail
    assert got["nouser"].reason == "no_user_turn" and got["refused"].reason == "engine_error"
    assert got["fine"].messages[-1]["content"].startswith("Target on:")
    assert all(q.file == "prepared.jsonl" and q.line == convs.index(q.record) + 1 for q in results if isinstance(q, Quarantined))  # fmt: skip
    assert tally.rows_in == 6 == tally.kept + sum(tally.quarantined.values())
    expected = {"requests": 4, "stop": 2, "length": 1, "error": 1, "empty": 1, "rejected": 1}
    assert {k: tally.replies[k] for k in expected} == expected
    # The other policies: a cut reply quarantined, an empty one kept.
    results, tally, _ = run(
        renderer, convs[:2], script, settings=RegenerateSettings.defaults(on_length="quarantine", on_empty="keep")
    )
    assert results[0].reason == "cut_by_max_tokens" and results[1].messages[-1]["content"] == ""
    assert tally.quarantined["cut_by_max_tokens"] == 1 and tally.kept == 1


def test_a_prompt_longer_than_max_model_len_is_quarantined_before_the_engine(renderer):
    settings = RegenerateSettings.defaults()
    plan = th.ThinkingPlan("auto", "keep", "inline", MARKS, "")
    engine = FakeEngine(renderer, echo)
    tally = ShardTally("p")
    runner = Runner(engine, renderer, settings, plan, [], 12, "prepared.jsonl", tally)
    [q] = list(runner.run([(1, conv([U1]))]))
    assert q.reason == "prompt_too_long" and "max_model_len is 12" in q.detail and not engine.prompts


def test_a_conversation_the_chat_template_raises_on_is_quarantined_and_the_rest_go_on(tmp_path, demo_model_dir):
    """A template's raise_exception (e.g. "roles must alternate") on one conversation: that conversation is
    quarantined as template_error, as tokenize quarantines it, not the whole shard stopped by a jinja2 traceback."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(demo_model_dir, folder)
    template = folder / "chat_template.jinja"
    guard = "{%- for m in messages %}{% if 'BOOM' in m.content %}{{ raise_exception('no BOOM here') }}{% endif %}{% endfor -%}"
    template.write_text(guard + template.read_text())
    bad = PromptRenderer.load(folder, trust_remote_code=False, chat_template_kwargs={})
    boom = {"role": "user", "content": "BOOM?"}
    results, tally, engine = run(bad, [conv([U1], "ok"), conv([U1, A1, boom], "boom")])
    assert results[0].regenerated["from"] == "ok"
    assert (
        results[1].reason == "template_error"
        and results[1].detail == "reply 1: the chat template raised: no BOOM here"
    )
    assert tally.quarantined["template_error"] == 1 and tally.kept == 1
    assert len(engine.prompts) == 2  # the good conversation's one reply, the bad one's first


def test_host_memory_is_bounded_by_max_in_flight(renderer):
    convs = [conv([{"role": "user", "content": f"Question {i}?"}], f"id{i}") for i in range(20)]
    results, tally, engine = run(renderer, convs, settings=RegenerateSettings.defaults(max_in_flight=4), per_step=1)
    assert engine.most_in_flight <= 4 and [r.regenerated["from"] for r in results] == [f"id{i}" for i in range(20)]


def test_settings_sampling_and_a_bad_value():
    s = RegenerateSettings.defaults(turns="last", sampling={"temperature": 0.7, "seed": 5}, max_num_seqs=64)
    assert (s.content.turns, s.speed.max_num_seqs, s.workflow.enabled) == ("last", 64, False)
    assert (s.content.sampling.temperature, s.content.sampling.seed, s.content.sampling.max_tokens) == (0.7, 5, 1024)
    assert not s.content.sampling.greedy and RegenerateSettings.defaults().content.sampling.greedy
    with pytest.raises(ValueError, match="regenerate.turns = 'first' is not allowed"):  # ConfigError, from the schema
        RegenerateSettings.defaults(turns="first")


# ---- the shard folder, merge, counts ------------------------------------------------------------------------


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _regenerate_all(tmp_path, renderer, demo_model_dir, convs, shards=2, script=echo):
    (tmp_path / "prepared").mkdir(exist_ok=True)
    prepared = _write_jsonl(tmp_path / "prepared" / "conversations.jsonl", convs)
    split = split_conversations(prepared, [tmp_path / "prompts" / f"shard_{k}.jsonl" for k in range(shards)])
    manifests = []
    for k in range(shards):
        engine = FakeEngine(renderer, script)
        manifests.append(
            regenerate_shard(
                str(tmp_path / "prompts" / f"shard_{k}.jsonl"), str(tmp_path / "out" / f"shard_{k}"), engine, renderer,
                RegenerateSettings.defaults(), max_model_len=1024, engine_info={"engine": "fake"}, model_path=str(demo_model_dir),
                trust_remote_code=False, shard=k,
            )
        )  # fmt: skip
    return prepared, split, manifests


def test_split_shards_are_contiguous_and_named_by_prepared_line(tmp_path):
    convs = [conv([U1], f"id{i}") for i in range(5)]
    prepared = _write_jsonl(tmp_path / "conversations.jsonl", convs)
    split = split_conversations(prepared, [tmp_path / "p" / f"shard_{k}.jsonl" for k in range(3)])
    assert [(s["first_line"], s["rows"]) for s in split["shards"]] == [(1, 2), (3, 2), (5, 1)]
    lines = [line for k in range(3) for line in (tmp_path / "p" / f"shard_{k}.jsonl").read_text().splitlines()]
    assert lines == prepared.read_text().splitlines()
    assert json.loads((tmp_path / "p" / "split.json").read_text()) == split
    split = split_conversations(prepared, [tmp_path / "q" / f"shard_{k}.jsonl" for k in range(7)])
    assert [s["rows"] for s in split["shards"]] == [1, 1, 1, 1, 1, 0, 0]  # more shards than rows: empty ones


def test_shard_folder_manifest_rerun_and_merge(tmp_path, renderer, demo_model_dir):
    convs = [conv([U1, A1, U2], f"id{i}", f"src.jsonl:{i + 1}") for i in range(4)] + [conv([SYS, A1], "nouser")]
    prepared, _, manifests = _regenerate_all(tmp_path, renderer, demo_model_dir, convs)
    shard = tmp_path / "out" / "shard_0"
    assert sorted(p.name for p in shard.iterdir()) == [
        "conversations.jsonl", "counts.json", "manifest.json", "quarantine.jsonl", "timings.json",
    ]  # fmt: skip
    m = manifests[0]
    for name, entry in m["files"].items():  # the manifest describes the files as they are
        import hashlib

        assert hashlib.sha256((shard / name).read_bytes()).hexdigest() == entry["sha256"]
    assert m["sampling"]["greedy"] and m["sampling"]["stop_token_ids"] == renderer.stop_token_ids()
    assert m["thinking"]["mode"] == "keep" and m["tokenizer"]["chat_template_sha256"] and m["counts"]["rows_in"] == 3
    assert m["prompts"]["first_line"] == 1 and manifests[1]["prompts"]["first_line"] == 4
    # A rerun of the shard writes the same bytes (timings.json holds wall-clock facts).
    before = {p.name: p.read_bytes() for p in shard.iterdir() if p.name != "timings.json"}
    regenerate_shard(
        str(tmp_path / "prompts" / "shard_0.jsonl"), str(shard), FakeEngine(renderer, echo), renderer, RegenerateSettings.defaults(),
        max_model_len=1024, engine_info={"engine": "fake"}, model_path=str(demo_model_dir), trust_remote_code=False,
        shard=0, code=m["code_version"],
    )  # fmt: skip
    assert {p.name: p.read_bytes() for p in shard.iterdir() if p.name != "timings.json"} == before
    # Merged: what tokenize reads, with rows in = regenerated + quarantined, and prepare's totals kept.
    out = tmp_path / "regenerated"
    prepared_counts = tmp_path / "prepared" / "counts.json"
    prepared_counts.write_text(json.dumps({"sources": ["src.jsonl"], "totals": {"kept": 5, "rows_in": 6}}))
    counts = merge_shards(
        [tmp_path / "out" / f"shard_{k}" for k in range(2)], prepared_counts,
        out / "conversations.jsonl", out / "quarantine.jsonl", out / "counts.json",
    )  # fmt: skip
    t = counts["totals"]
    assert (t["rows_in"], t["kept"], t["quarantined"]["no_user_turn"]) == (5, 4, 1)
    assert counts["prepared"]["totals"]["kept"] == 5 and len(counts["shard_manifests"]) == 2
    regenerated = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert [c["regenerated"]["from"] for c in regenerated] == ["id0", "id1", "id2", "id3"]
    [q] = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert (q["reason"], q["line"], q["record"]["id"]) == ("no_user_turn", 5, "nouser")
    # tokenize's stop reads these counts too: none regenerated is one line naming the reasons.
    none = json.loads((out / "counts.json").read_text())
    none["totals"]["kept"] = 0
    (tmp_path / "none.json").write_text(json.dumps(none))
    with pytest.raises(NoConversationsError, match=r"regenerate quarantined all 5 conversations \(no_user_turn 1\)"):
        require_conversations(tmp_path / "none.json", out / "quarantine.jsonl")


def test_merge_refuses_a_changed_or_unfinished_shard(tmp_path, renderer, demo_model_dir):
    convs = [conv([U1], f"id{i}") for i in range(4)]
    _regenerate_all(tmp_path, renderer, demo_model_dir, convs)
    counts = tmp_path / "prepared" / "counts.json"
    counts.write_text(json.dumps({"totals": {"kept": 4}}))
    shards = [tmp_path / "out" / f"shard_{k}" for k in range(2)]
    outs = [tmp_path / "m" / n for n in ("c.jsonl", "q.jsonl", "n.json")]
    with open(shards[1] / "conversations.jsonl", "a") as f:
        f.write("{}\n")
    with pytest.raises(ShardError, match="differ from its shard's manifest.json"):
        merge_shards(shards, counts, *outs)
    (shards[1] / "manifest.json").unlink()
    with pytest.raises(ShardError, match="has no manifest.json"):
        merge_shards(shards, counts, *outs)
    assert not outs[0].exists()  # nothing half-merged under the final name


def test_prompt_only_records_are_kept_only_for_the_regenerate_stage(tmp_path):
    src = _write_jsonl(tmp_path / "src.jsonl", [{"messages": [U1]}, {"messages": [U1, A1]}])

    def kept(**kwargs):
        kwargs = {"max_line_bytes": 1 << 24, "allow_no_user_turn": False, **kwargs}
        counts = prepare([src], tmp_path / "c.jsonl", tmp_path / "q.jsonl", tmp_path / "n.json", **kwargs)
        return counts["totals"]["kept"], counts["totals"]["quarantined"]["no_assistant_turn"]

    assert kept() == (1, 1)  # without the stage: quarantined as today
    assert kept(allow_prompt_only=True) == (2, 0)


def test_review_shows_regenerated_beside_original(tmp_path, renderer, demo_model_dir):
    convs = [conv([U1, A1, U2, A2], f"id{i}") for i in range(6)]
    prepared, _, _ = _regenerate_all(tmp_path, renderer, demo_model_dir, convs, shards=1)
    regenerated = tmp_path / "out" / "shard_0" / "conversations.jsonl"
    pairs = sample_pairs(prepared, regenerated, 3, seed=1)
    assert pairs == sample_pairs(prepared, regenerated, 3, seed=1) and len(pairs) == 3
    assert all(o["id"] == r["regenerated"]["from"] for o, r in pairs)
    text = side_by_side(*pairs[0], width=120)
    row = next(line for line in text.splitlines() if "Dataset answer one." in line)
    assert "Target on: How do I fix a bike chain?" in row  # the two replies of turn 1 on one line
    assert text.count("[user] And the brakes?") == 2
    assert "3 regenerated conversations" in review(prepared, regenerated, n=3)


def test_a_job_killed_mid_generation_leaves_no_finished_looking_shard_and_its_rerun_is_byte_identical(
    tmp_path, renderer, demo_model_dir
):
    """SIGKILL in the middle of a shard's generation: its folder holds temp files only, no manifest.json (merge
    and Snakemake's incomplete marker both refuse it); the job run again from its start writes a clean run's
    bytes. (The workflow-level kill with vLLM: tests/test_vllm_regenerate.py.)"""
    convs = [conv([U1, A1, U2], f"id{i}") for i in range(6)]
    _regenerate_all(tmp_path, renderer, demo_model_dir, convs)
    clean = tmp_path / "out" / "shard_1"
    killed = tmp_path / "killed"
    helper = Path(__file__).parent / "testkit" / "regenerate.py"
    args = [sys.executable, str(helper), str(demo_model_dir), str(tmp_path / "prompts" / "shard_1.jsonl"), str(killed), "1"]  # fmt: skip
    proc = subprocess.run(
        args, env={**os.environ, "EAGLE3PREP_KILL_AT": "regenerate.step:shard=1,step=3"}, capture_output=True,
        text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    left = sorted(p.name for p in killed.iterdir())
    assert "manifest.json" not in left and "conversations.jsonl" not in left  # nothing under a final name
    assert any(n.startswith(".tmp-conversations.jsonl.") for n in left), left
    subprocess.run(args[:-1] + ["1"], check=True, capture_output=True)  # the same job again
    assert not [p for p in killed.iterdir() if p.name.startswith(".tmp-")]

    def data(d: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in d.iterdir() if p.name not in ("timings.json", "manifest.json")}

    assert data(killed) == data(clean)
    shutil.rmtree(killed)


def test_max_model_len_defaults_to_tokenize_max_seq_len_within_the_context(demo_model_dir):
    assert model_len(RegenerateSettings.defaults(), demo_model_dir, 256) == 256  # tokenize cuts rows at 256 anyway
    assert model_len(RegenerateSettings.defaults(), demo_model_dir, 4096) == 1024  # the demo model's context
    assert model_len(RegenerateSettings.defaults(max_model_len=512), demo_model_dir, 256) == 512
    with pytest.raises(RegenerateError, match="above the model's context of 1024 tokens"):
        model_len(RegenerateSettings.defaults(max_model_len=2048), demo_model_dir, 256)


def test_the_report_funnel_names_what_the_stage_quarantined():
    from eagle3prep.report import data

    tally = ShardTally("p/shard_0.jsonl", rows_in=5, kept=3)
    tally.quarantined.update(tool_turns=1, prompt_too_long=1)
    tally.replies.update(requests=5, length=5)
    prepared = {"sources": ["a.jsonl"], "totals": {"rows_in": 7, "duplicates": 1, "kept": 5, "files": 1,
                                                   "quarantined": {"invalid_json": 1}}}  # fmt: skip
    counts = merged_counts([{"files": [tally.file_json()]}], prepared, {"conversations": 3, "quarantine": 2})
    stats = {
        "quarantined": {},
        "rows": 3,
        "tokens": 90,
        "truncated_rows": 0,
        "truncated_tokens": 0,
        "max_seq_len": 128,
    }
    steps = data.funnel(counts, stats)
    assert steps[:6] == [
        ("rows in the sources", 7, "1 files"),
        ("duplicates dropped", -1, "same content as an earlier row"),
        ("quarantined by prepare", -1, "invalid_json 1"),
        ("conversations kept by prepare", 5, ""),
        ("quarantined by regenerate", -2, "prompt_too_long 1, tool_turns 1"),
        ("conversations regenerated", 3, "5 replies by the target, 5 cut by max_tokens"),
    ]


def test_the_engine_is_configured_from_regenerate_and_fails_in_one_line():
    from eagle3prep.regenerate.engine import VLLMEngine
    from eagle3prep.vllm.engine.errors import engine_error

    settings = RegenerateSettings.defaults(dtype="float32", tp_size=2, engine_args={"max_num_seqs": 64})
    engine = VLLMEngine("m", settings, settings.content.sampling, [4], 512, False)
    fix = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}  # a known bug's workaround wins
    kwargs = engine.engine_kwargs(fix)
    assert kwargs["skip_tokenizer_init"] and kwargs["tensor_parallel_size"] == 2 and kwargs["max_model_len"] == 512
    assert kwargs["max_num_seqs"] == 64 and kwargs["compilation_config"] == fix["compilation_config"]
    assert "quantization" not in kwargs  # None: vLLM's own default
    children = "Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory.\n"
    err = engine_error(
        RuntimeError("Engine core initialization failed. See root cause above."), children, version="0.32.0",
        arch="LlamaForCausalLM", path="generate", doing="for generation", section="regenerate",
    )  # fmt: skip
    assert str(err) == (
        "vLLM 0.32.0 could not start LlamaForCausalLM for generation: torch.OutOfMemoryError: CUDA out of memory; "
        "lower regenerate.gpu_memory_utilization or regenerate.max_num_batched_tokens"
    )


def test_an_engine_that_dies_mid_shard_is_one_line_naming_the_shard(renderer):
    """VLLMEngine.step turns a dead engine into one EngineError line (tests/test_engine_memory.py); the runner adds
    which regenerate shard it was on."""
    from eagle3prep.vllm.engine.errors import EngineError

    class Dying(FakeEngine):
        def step(self):
            raise EngineError("vLLM 0.26.0 died generating replies: CUDA out of memory; lower regenerate.x")

    settings = RegenerateSettings.defaults()
    plan = th.ThinkingPlan("auto", "keep", "inline", ("<think>", "</think>"), "test")
    runner = Runner(Dying(renderer, echo), renderer, settings, plan, renderer.stop_token_ids(), 1024, "p.jsonl",
                    ShardTally("prompts.jsonl"), shard=7)  # fmt: skip
    with pytest.raises(EngineError, match=r"^regenerate shard 7: vLLM 0.26.0 died generating replies: CUDA out"):
        list(runner.run([(1, conv([U1]))]))
