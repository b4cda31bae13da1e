"""Write the demo inputs in this folder: raw conversations in two shapes and the tokenizer corpus.

    python resources/demo/make_demo_data.py        # stdlib + pyarrow; writes next to this file

Deterministic (fixed seed, no clock, no hash order), so the committed files only change when this
script does. The malformed records and cross-file duplicates are planted on purpose; README.md lists
them. Output of the last run:
    sharegpt.jsonl     110 lines (105 conversations + 5 malformed)
    openai.jsonl       110 lines (105 conversations + 5 malformed)
    sharegpt.parquet    80 conversations (3 are copies of openai.jsonl ones)
    openai.parquet      80 conversations (3 are copies of sharegpt.jsonl ones)
    tokenizer_corpus.txt 3000 sentences
With the demo tokenizer and max_seq_len 256 the 364 unique conversations give 362 rows, 25 of them
truncated, and 2 quarantined as no_assistant_tokens (the make_long_prompt ones).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SEED = 20240611
HERE = Path(__file__).resolve().parent

TOPICS = {
    "gardening": ["tomato", "rose", "compost", "seedling", "hedge", "soil", "watering can", "greenhouse"],
    "astronomy": ["comet", "telescope", "nebula", "moon", "orbit", "planet", "star chart", "eclipse"],
    "cooking": ["bread", "soup", "onion", "oven", "recipe", "pancake", "spice", "frying pan"],
    "bicycles": ["chain", "saddle", "brake", "tyre", "gear", "pedal", "frame", "helmet"],
    "music": ["guitar", "melody", "piano", "rhythm", "chord", "choir", "violin", "drum"],
    "history": ["castle", "empire", "treaty", "museum", "harbour", "village", "bridge", "library"],
    "programming": ["function", "loop", "variable", "compiler", "test", "database", "server", "bug"],
    "weather": ["cloud", "storm", "rain", "breeze", "forecast", "frost", "thunder", "rainbow"],
    "trains": ["station", "ticket", "platform", "timetable", "carriage", "signal", "railway", "engine"],
    "birds": ["sparrow", "owl", "feather", "nest", "heron", "robin", "wing", "egg"],
}
# fmt: off
ADJECTIVES = ["small", "large", "quiet", "bright", "old", "new", "heavy", "simple", "strange", "careful",
              "warm", "cold", "quick", "slow", "green", "golden", "tiny", "useful", "gentle", "busy"]
VERBS = ["check", "clean", "move", "build", "measure", "watch", "fix", "store", "compare", "prepare",
         "test", "choose", "draw", "explain", "plan", "repair", "sort", "protect"]
# fmt: on
ADVERBS = ["slowly", "carefully", "often", "rarely", "gently", "quickly", "every morning", "once a week"]
NAMES = ["Alice", "Bob", "Chen", "Dara", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kemi", "Lena"]
PLACES = ["the kitchen", "the garden", "the city", "the hills", "the workshop", "the school", "the coast"]

QUESTIONS = [
    "How do I {verb} a {adj} {thing}?",
    "What is the best way to {verb} the {thing}?",
    "Why does my {thing} look so {adj}?",
    "Can you explain what a {thing} is?",
    "Is it a good idea to {verb} the {thing} {adv}?",
    "What should I know about {topic}?",
    "My friend {name} asked me about the {thing}. What should I tell {pron}?",
    "How many {thing}s do I need for {place}?",
    "Could you give me a short tip about {topic}?",
    "What is the difference between a {thing} and a {thing2}?",
]
STATEMENTS = [
    "A {adj} {thing} is easier to {verb} than most people think.",
    "You should {verb} the {thing} {adv}, because it lasts longer that way.",
    "Many people in {place} {verb} their {thing} {adv}.",
    "The {thing} and the {thing2} work together in {topic}.",
    "{name} once said that a {adj} {thing} is worth the effort.",
    "It takes about {n} minutes to {verb} a {thing}.",
    "If the {thing} feels {adj}, {verb} it again and wait a little.",
    "Most {topic} guides say the {thing} matters more than the {thing2}.",
    "Start with a {adj} {thing}, then {verb} the {thing2}.",
    "There are {n} common mistakes, and the first one is to forget the {thing}.",
    "In {place}, a {thing} usually costs {n} coins.",
    "Try not to {verb} the {thing} when it is {adj}.",
]
FOLLOW_UPS = [
    "Thanks! And what about the {thing}?",
    "That helps. How long does it take?",
    "Could you say that more briefly?",
    "What if the {thing} is {adj}?",
    "Why is that?",
    "Can you give me a list of steps?",
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant who knows a lot about {topic}.",
    "You are a patient teacher. Answer in plain English.",
    "You answer questions about {topic} in a friendly tone. Keep answers short.",
    "You are an expert on {topic}. Be precise and practical.",
]
GREETINGS = ["Hello!", "Good question.", "Sure.", "Of course.", "Let me help with that.", "Happy to explain."]


def fill(rng: random.Random, template: str, topic: str) -> str:
    thing, thing2 = rng.sample(TOPICS[topic], 2)
    return template.format(
        thing=thing,
        thing2=thing2,
        topic=topic,
        adj=rng.choice(ADJECTIVES),
        verb=rng.choice(VERBS),
        adv=rng.choice(ADVERBS),
        name=rng.choice(NAMES),
        pron=rng.choice(["her", "him", "them"]),
        place=rng.choice(PLACES),
        n=rng.randint(2, 90),
    )


def answer(rng: random.Random, topic: str, n_sentences: int) -> str:
    head = rng.choice(GREETINGS) + " " if rng.random() < 0.3 else ""
    if n_sentences >= 6 and rng.random() < 0.5:  # a numbered list now and then
        steps = "".join(f"\n{i}. " + fill(rng, rng.choice(STATEMENTS), topic) for i in range(1, n_sentences + 1))
        return head + "Here are the steps:" + steps
    return head + " ".join(fill(rng, rng.choice(STATEMENTS), topic) for _ in range(n_sentences))


def make_conversation(rng: random.Random, long: bool = False) -> list[dict[str, str]]:
    """OpenAI-shaped messages: optional system, then 1-4 user/assistant exchanges."""
    topic = rng.choice(sorted(TOPICS))
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": fill(rng, rng.choice(SYSTEM_PROMPTS), topic)})
    for turn in range(rng.choice([1, 1, 1, 1, 2, 2, 2, 3, 3, 4])):
        q = rng.choice(QUESTIONS) if turn == 0 else rng.choice(FOLLOW_UPS)
        messages.append({"role": "user", "content": fill(rng, q, topic)})
        # follow-ups get short answers, so that mostly the planted long ones pass 256 demo tokens
        sizes = [1, 1, 1, 2, 2, 3] if turn == 0 else [1, 1, 2]
        n = rng.randint(12, 18) if long and turn == 0 else rng.choice(sizes)
        messages.append({"role": "assistant", "content": answer(rng, topic, n)})
    return messages


def make_long_prompt(rng: random.Random) -> list[dict[str, str]]:
    """A user turn so long that at max_seq_len 256 no assistant token is left (-> no_assistant_tokens)."""
    topic = rng.choice(sorted(TOPICS))
    notes = " ".join(fill(rng, rng.choice(STATEMENTS), topic) for _ in range(20))
    return [
        {"role": "user", "content": f"Please read my notes about {topic}. {notes} What do you think?"},
        {"role": "assistant", "content": answer(rng, topic, 2)},
    ]


TO_SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}


def to_sharegpt(messages: list[dict[str, str]], conv_id: str) -> dict:
    return {
        "id": conv_id,
        "conversations": [{"from": TO_SHAREGPT[m["role"]], "value": m["content"]} for m in messages],
    }


def make_set(rng: random.Random, n: int, n_long: int) -> list[list[dict[str, str]]]:
    long_at = set(rng.sample(range(n), n_long))
    return [make_conversation(rng, long=i in long_at) for i in range(n)]


def write_jsonl(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def dumps(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False)


def main() -> None:
    rng = random.Random(SEED)
    sg = make_set(rng, 105, n_long=4)
    oa = make_set(rng, 105, n_long=4)
    sg_pq = make_set(rng, 76, n_long=2) + [make_long_prompt(rng)]
    oa_pq = make_set(rng, 76, n_long=2) + [make_long_prompt(rng)]
    # Exact duplicates across files (same messages after normalization, different shape or file).
    sg_pq += [oa[5], oa[40], oa[77]]
    oa_pq += [sg[3], sg[50], sg[99]]

    # --- sharegpt.jsonl: 105 good records, 5 malformed ones at fixed positions
    sg_lines = [dumps(to_sharegpt(m, f"sg-{i:04d}")) for i, m in enumerate(sg)]
    bad_sg = {
        10: '{"id": "sg-bad-json", "conversations": [{"from": "human", "value": "unterminated',
        25: dumps(
            {
                "id": "sg-bad-missing-role",
                "conversations": [
                    {"value": "Where does this message come from?"},
                    {"from": "gpt", "value": "Nobody knows."},
                ],
            }
        ),
        40: dumps(
            {
                "id": "sg-bad-unknown-role",
                "conversations": [
                    {"from": "human", "value": "Tell me a story."},
                    {"from": "narrator", "value": "Once upon a time."},
                    {"from": "gpt", "value": "The end."},
                ],
            }
        ),
        55: dumps(
            {
                "id": "sg-bad-empty-content",
                "conversations": [{"from": "human", "value": "Say nothing, please."}, {"from": "gpt", "value": ""}],
            }
        ),
        70: dumps(
            {
                "id": "sg-bad-no-assistant",
                "conversations": [
                    {"from": "system", "value": "You are terse."},
                    {"from": "human", "value": "Is anyone there?"},
                ],
            }
        ),
    }
    for pos in sorted(bad_sg):
        sg_lines.insert(pos, bad_sg[pos])
    write_jsonl(HERE / "sharegpt.jsonl", sg_lines)

    # --- openai.jsonl: same malformed cases in OpenAI shape
    oa_lines = [dumps({"messages": m}) for m in oa]
    bad_oa = {
        7: '{"messages": [{"role": "user", "content": "cut off here"}, {"role": "assis',
        33: dumps({"messages": [{"content": "I have no role."}, {"role": "assistant", "content": "Odd."}]}),
        48: dumps(
            {
                "messages": [
                    {"role": "user", "content": "Who speaks next?"},
                    {"role": "narrator", "content": "A voice from nowhere."},
                    {"role": "assistant", "content": "I do."},
                ]
            }
        ),
        66: dumps(
            {
                "messages": [
                    {"role": "user", "content": ""},
                    {"role": "assistant", "content": "You sent an empty message."},
                ]
            }
        ),
        91: dumps({"messages": [{"role": "user", "content": "Hello?"}, {"role": "user", "content": "Hello again?"}]}),
    }
    for pos in sorted(bad_oa):
        oa_lines.insert(pos, bad_oa[pos])
    write_jsonl(HERE / "openai.jsonl", oa_lines)

    # --- parquet files: well-formed only
    sg_rows = [to_sharegpt(m, f"sgp-{i:04d}") for i, m in enumerate(sg_pq)]
    turn = pa.struct([("from", pa.string()), ("value", pa.string())])
    table = pa.table(
        {
            "id": pa.array([r["id"] for r in sg_rows], pa.string()),
            "conversations": pa.array([r["conversations"] for r in sg_rows], pa.list_(turn)),
        }
    )
    pq.write_table(table, HERE / "sharegpt.parquet")
    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    pq.write_table(pa.table({"messages": pa.array(oa_pq, pa.list_(msg))}), HERE / "openai.parquet")

    # --- tokenizer corpus: same vocabulary as the conversations, one sentence per line
    crng = random.Random(SEED + 1)
    lines = []
    for _ in range(3000):
        topic = crng.choice(sorted(TOPICS))
        pool = crng.choice([STATEMENTS, STATEMENTS, QUESTIONS, FOLLOW_UPS, SYSTEM_PROMPTS, GREETINGS])
        lines.append(fill(crng, crng.choice(pool), topic))
    (HERE / "tokenizer_corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")

    print(
        f"sharegpt.jsonl {len(sg_lines)} lines, openai.jsonl {len(oa_lines)} lines, "
        f"sharegpt.parquet {len(sg_rows)} rows, openai.parquet {len(oa_pq)} rows, corpus {len(lines)} lines"
    )


if __name__ == "__main__":
    main()
