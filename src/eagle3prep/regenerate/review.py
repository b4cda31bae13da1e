"""Look at regenerated conversations before spending GPU time on their hidden states: N of them, drawn at random,
printed side by side with the dataset's originals, turn by turn.

    snakemake regenerate_review                       # results/regenerated/review.txt (regenerate.review_samples)
    python -m eagle3prep.regenerate.review -n 5       # the same to the terminal; --seed draws others
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import textwrap
import unicodedata
from pathlib import Path
from typing import Any

MAX_CHARS = 600  # characters shown per message (the rest is counted)


def sample_pairs(prepared: str | Path, regenerated: str | Path, n: int, seed: int = 0) -> list[tuple[dict, dict]]:
    """n regenerated conversations (a uniform sample, fixed by `seed`) with their originals, in file order."""
    rng = random.Random(seed)
    picked: list[tuple[int, dict]] = []
    with open(regenerated, encoding="utf-8") as f:
        for i, line in enumerate(f):  # reservoir sampling: one pass, n conversations held
            if len(picked) < n:
                picked.append((i, json.loads(line)))
            elif (j := rng.randrange(i + 1)) < n:
                picked[j] = (i, json.loads(line))
    picked.sort(key=lambda p: p[0])
    wanted = {conv["regenerated"]["from"] for _, conv in picked}
    originals: dict[str, dict] = {}
    with open(prepared, encoding="utf-8") as f:
        for line in f:
            conv = json.loads(line)
            if conv["id"] in wanted:
                originals[conv["id"]] = conv
    return [(originals.get(conv["regenerated"]["from"], {"messages": []}), conv) for _, conv in picked]


def _message_text(m: dict[str, Any], max_chars: int) -> str:
    parts = []
    if m.get("reasoning_content"):
        parts.append(f"(thinking) {m['reasoning_content']}")
    if isinstance(m.get("content"), list):  # content parts: text, and images by where prepare read them
        parts += [p["text"] if p["type"] == "text" else f"(image) {_image_name(p)}" for p in m["content"]]
    elif m.get("content"):
        parts.append(m["content"])
    for call in m.get("tool_calls") or []:
        fn = call.get("function", {})
        parts.append(f"(tool call) {fn.get('name')}({json.dumps(fn.get('arguments'), ensure_ascii=False)})")
    text = _printable("\n".join(parts)) if parts else "(empty)"
    if len(text) > max_chars:
        text = text[:max_chars] + f" ... (+{len(text) - max_chars} chars)"
    return f"[{m['role']}] {text}"


def _image_name(part: dict[str, Any]) -> str:
    ref = str(part.get("image", ""))
    return f"data: URI, sha256 {part.get('sha256', '')[:12]}" if ref.startswith("data:") else ref


def _printable(text: str) -> str:
    """Control characters a model wrote (a random or broken target writes many) shown as escapes, not sent to
    the terminal; newlines and tabs stay."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}" for c in text)


def _turns(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Messages cut before each user message: both sides keep the dataset's user messages, so turns align."""
    turns: list[list[dict[str, Any]]] = [[]]
    for m in messages:
        if m["role"] == "user" and turns[-1]:
            turns.append([])
        turns[-1].append(m)
    return turns


def _column(messages: list[dict[str, Any]], width: int, max_chars: int) -> list[str]:
    lines = []
    for m in messages:
        for para in _message_text(m, max_chars).splitlines() or [""]:
            lines += textwrap.wrap(para, width) or [""]
    return lines


def side_by_side(original: dict, regenerated: dict, width: int = 160, max_chars: int = MAX_CHARS) -> str:
    """One conversation: a header, then the original (left) and the regenerated (right) turn by turn."""
    col = (width - 3) // 2
    meta = regenerated.get("regenerated", {})
    reasons = ", ".join(f"{r['finish_reason']} ({r['tokens']} tok)" for r in meta.get("replies", []))
    out = [
        "=" * width,
        f"{regenerated.get('source')}  id {meta.get('from', '?')[:12]} -> {regenerated['id'][:12]}  "
        f"seed {meta.get('seed')}  replies: {reasons}",
        f"{'original (dataset)':<{col}} | regenerated (target)",
        f"{'-' * col}-+-{'-' * col}",
    ]
    left, right = _turns(original["messages"]), _turns(regenerated["messages"])
    for i in range(max(len(left), len(right))):
        a = _column(left[i] if i < len(left) else [], col, max_chars)
        b = _column(right[i] if i < len(right) else [], col, max_chars)
        out += [f"{x:<{col}} | {y}".rstrip() for x, y in zip(a + [""] * (len(b) - len(a)), b + [""] * (len(a) - len(b)), strict=True)]  # fmt: skip
        out.append(f"{'':<{col}} |")
    return "\n".join(out)


def review(prepared: str | Path, regenerated: str | Path, n: int = 5, seed: int = 0, width: int = 160,
           max_chars: int = MAX_CHARS) -> str:  # fmt: skip
    """The review text: a line of counts, then n conversations side by side."""
    pairs = sample_pairs(prepared, regenerated, n, seed)
    counts_path = Path(regenerated).with_name("counts.json")
    head = (
        f"{len(pairs)} regenerated conversations of {regenerated} (seed {seed}) beside their originals in {prepared}"
    )
    if counts_path.is_file():
        t = json.loads(counts_path.read_text(encoding="utf-8"))["totals"]
        quarantined = ", ".join(f"{r} {k}" for r, k in t["quarantined"].items() if k) or "none"
        head += f"\n{t['kept']} of {t['rows_in']} conversations regenerated; quarantined: {quarantined}"
    return "\n".join([head, *(side_by_side(o, r, width, max_chars) for o, r in pairs)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default="results", help="the results folder (default: results)")
    parser.add_argument("-n", type=int, default=5, help="conversations to show (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="which ones (default 0)")
    parser.add_argument("--width", type=int, default=shutil.get_terminal_size((160, 40)).columns)
    parser.add_argument("--max-chars", type=int, default=MAX_CHARS, help="characters shown per message")
    args = parser.parse_args(argv)
    results = Path(args.results)
    regenerated = results / "regenerated" / "conversations.jsonl"
    if not regenerated.is_file():
        print(
            f"{regenerated} does not exist yet: run `snakemake regenerate_review` (or the workflow)", file=sys.stderr
        )
        return 1
    sys.stdout.write(
        review(
            results / "prepared" / "conversations.jsonl", regenerated, args.n, args.seed, args.width, args.max_chars
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
