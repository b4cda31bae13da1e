"""eagle3prep's tokenize against vllm-project/speculators 0.9's own preprocessing, same conversations.

Run from the repo root after `make demo` (needs .venv, which has speculators 0.9 installed):
    .venv/bin/python bench/bench_vs_speculators.py [--conversations 2000] [--repeat 3] [--max-len 1024]

Both sides get the same synthetic conversations (bench_cpu_stages.synthetic_conversations), the same
tokenizer and chat template (the demo's, then bench_cpu_stages' 'large' one), the same max length
and an assistant-only loss mask. speculators 0.9 (data_generation/preprocessing.py,
build_speculator_training_dataset) renders each conversation through a vLLM server's
/v1/chat/completions/render endpoint, twice per assistant turn, and derives the mask from the
boundary between the two renders (one training row per assistant turn). No vLLM server runs here,
so its render calls are served two ways, both by the same transformers tokenizer:
  in-process  `_encode_render` replaced by a direct apply_chat_template call: no HTTP, its cheapest case;
  http        its unchanged code (httpx, pooled client) against a stdlib HTTP server in another process
              standing in for vLLM's render endpoint (vLLM's own server does more per request).
After one untimed warm-up call of each (imports, datasets' first map), each repetition times every
contestant once, in turn (paired); the table gives the median and the per-repetition ratio range. Then the outputs are compared: speculators' last row of a conversation
is the whole conversation, so its ids must equal ours; the union of its per-turn masks, laid on those
ids, is compared with our mask, and the tokens where they differ are named. Last, a cProfile of each
side on 1 process says where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_stages import bench_inputs, tokenize_into  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def local_render(tok, messages, *, add_generation_prompt, max_length, tools=None):
    """What vLLM's render endpoint returns: the chat template's token ids, cut to max_length on the right."""
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
    )
    return ids["input_ids"][:max_length]


def serve_render(model_dir: str, port_file: str) -> None:
    """A stand-in for vLLM's /v1/chat/completions/render: HTTP/1.1 keep-alive, JSON in, token_ids out."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes: with Nagle on, each response waits ~40 ms for a
        # delayed ACK, which would be the stub's cost, not speculators'.
        disable_nagle_algorithm = True

        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = local_render(
                tok,
                body["messages"],
                add_generation_prompt=body["add_generation_prompt"],
                max_length=body.get("truncate_prompt_tokens") or 1 << 30,
            )
            out = json.dumps({"token_ids": ids}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):  # one line per request would swamp the output
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


def start_server(model_dir: Path, tmp: Path):
    import multiprocessing as mp

    port_file = tmp / f"port-{model_dir.name}"
    proc = mp.get_context("spawn").Process(target=serve_render, args=(str(model_dir), str(port_file)), daemon=True)
    proc.start()
    while not port_file.is_file() or not port_file.read_text():
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


@contextlib.contextmanager
def in_process_render(tok):
    """speculators' render calls answered by `tok` in the calling process (no HTTP round trip)."""
    from speculators.data_generation import preprocessing as sp

    original = sp._encode_render
    sp._encode_render = lambda conv, _endpoint, **kw: local_render(
        tok, conv, add_generation_prompt=kw["add_generation_prompt"], max_length=kw["max_length"]
    )
    try:
        yield sp
    finally:
        sp._encode_render = original


def speculators_build(model_dir: Path, convs: list[dict], max_len: int, workers: int, endpoint: str | None):
    """speculators' build_speculator_training_dataset on `convs`; endpoint None = in-process render."""
    from datasets import Dataset
    from speculators.data_generation import preprocessing as sp
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ds = Dataset.from_list([{"conversations": c["messages"]} for c in convs])
    with in_process_render(tok) if endpoint is None else contextlib.nullcontext():
        return sp.build_speculator_training_dataset(
            ds, tok, max_length=max_len, num_proc=workers, render_endpoint=endpoint or "in-process"
        )


def speculators_batch(model_dir: Path, convs: list[dict], max_len: int):
    """speculators' per-batch function alone, in this process (datasets.map runs it in a child)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    with in_process_render(tok) as sp:
        return sp._preprocess_batch({"conversations": [c["messages"] for c in convs]}, False, "in-process", max_len)


def ours(model_dir: Path, conversations: Path, out: Path, max_len: int, workers: int) -> dict:
    return tokenize_into(out, model_dir, conversations, max_len, workers)


def group_rows(convs: list[dict], theirs) -> list[list[tuple[list[int], list[int]]]]:
    """speculators' rows per conversation: one per assistant turn, in order, each extending the last.

    A turn whose context alone fills max_length yields no row, so a conversation may have fewer rows
    than turns: its rows are the run of prefix-extending rows (at most one per turn) at this point.
    """
    rows, i = [], 0
    for c in convs:
        turns, mine = sum(m["role"] == "assistant" for m in c["messages"]), []
        while i < len(theirs) and len(mine) < turns:
            ids, mask = theirs[i]["input_ids"].tolist(), theirs[i]["loss_mask"].tolist()
            if mine and ids[: len(mine[-1][0])] != mine[-1][0]:
                break
            mine.append((ids, mask))
            i += 1
        rows.append(mine)
    assert i == len(theirs), f"{len(theirs) - i} speculators rows left over after grouping"
    return rows


def compare(model_dir: Path, convs: list[dict], ours_dir: Path, theirs, max_len: int) -> list[str]:
    """Ids and masks (speculators' per-turn masks united on its last row) against ours, row by row.

    Where speculators kept every turn, its last row is the whole conversation cut to max_len and must
    equal ours; where it dropped the last turns (their context filled max_len), its last row must be a
    prefix of ours. The tokens where the masks differ are named, with the token before each.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    mine = [json.loads(line) for k in range(4) for line in (ours_dir / f"s{k}.jsonl").read_text().splitlines()]
    grouped = group_rows(convs, theirs)
    full = partial = same_ids = same_mask = no_row = 0
    diff_tokens: Counter[str] = Counter()
    diff_side: Counter[str] = Counter()
    for c, r, per_turn in zip(convs, mine, grouped, strict=True):
        if not per_turn:
            no_row += 1
            continue
        ids, mask = per_turn[-1][0], [0] * len(per_turn[-1][0])
        for _ids, m in per_turn:
            for p, v in enumerate(m):
                mask[p] |= v
        every_turn = len(per_turn) == sum(m["role"] == "assistant" for m in c["messages"])
        full += every_turn
        partial += not every_turn
        ours_ids, ours_mask = (r["input_ids"], r["loss_mask"]) if every_turn else (
            r["input_ids"][: len(ids)], r["loss_mask"][: len(ids)]
        )  # fmt: skip
        if ours_ids != ids:
            continue
        same_ids += 1
        same_mask += ours_mask == mask
        for p, (a, b) in enumerate(zip(ours_mask, mask, strict=True)):
            if a != b:
                diff_tokens[repr(tok.decode(ids[max(p - 1, 0) : p + 1]))] += 1  # the token and the one before
                diff_side["speculators 1, eagle3prep 0" if b else "eagle3prep 1, speculators 0"] += 1
    n = len(convs)
    return [
        f"conversations: {n}; speculators rows: {len(theirs)} (one per assistant turn whose context fits "
        f"in {max_len}); every turn kept: {full}, last turns dropped: {partial}, no row at all: {no_row}",
        f"input_ids identical (whole conversation, or speculators' last row as a prefix of ours): {same_ids}/{n - no_row}",
        f"loss_mask identical on those: {same_mask}/{same_ids}",
        f"positions where the masks differ: {dict(diff_side)}; those tokens, each after the token before it: "
        f"{dict(diff_tokens.most_common(5))}",
    ]


def profile(fn, top: int = 12) -> str:
    """cProfile of one call: the functions with the most own time (tottime)."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = buf.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    total = next(line for line in lines if "function calls" in line).strip()
    return "\n".join([total, *lines[start : start + top + 1]])


def bench_one(name: str, model: Path, convs: list[dict], tmp: Path, args) -> None:
    import logging

    logging.getLogger("speculators").setLevel(logging.ERROR)  # its per-batch fan-out notes
    conversations = tmp / "conv.jsonl"
    n = len(convs)
    proc, endpoint = start_server(model, tmp)
    contestants = {
        "eagle3prep tokenize, 2 workers": lambda: ours(model, conversations, tmp / f"ours-{name}", args.max_len, 2),
        "eagle3prep tokenize, 1 process": lambda: ours(model, conversations, tmp / f"ours1-{name}", args.max_len, 1),
        "speculators, in-process render, 1 worker (its default here)": lambda: speculators_build(
            model, convs, args.max_len, 1, None
        ),
        "speculators, in-process render, 2 workers": lambda: speculators_build(model, convs, args.max_len, 2, None),
        "speculators, HTTP render stub, 1 worker": lambda: speculators_build(model, convs, args.max_len, 1, endpoint),
    }
    warm = convs[:20]  # warm-up, not timed: imports and datasets' first map cost seconds once per process
    speculators_build(model, warm, args.max_len, 1, None)
    speculators_build(model, warm, args.max_len, 2, None)
    speculators_build(model, warm, args.max_len, 1, endpoint)
    ours(model, conversations, tmp / f"warm-{name}", args.max_len, 2)
    times: dict[str, list[float]] = {k: [] for k in contestants}
    results = {}
    for _ in range(args.repeat):
        for label, fn in contestants.items():
            t0 = time.perf_counter()
            results[label] = fn()
            times[label].append(time.perf_counter() - t0)
    proc.terminate()
    stats = results["eagle3prep tokenize, 2 workers"]
    print(f"## tokenizer '{name}': {stats['tokens'] / stats['rows']:.0f} tokens/row, max length {args.max_len}")
    print(f"{n} conversations, {sum(turn['role'] == 'assistant' for c in convs for turn in c['messages'])} assistant turns; "
          f"times in s per repetition (paired, {args.repeat} repetitions)")  # fmt: skip
    base = times["eagle3prep tokenize, 2 workers"]
    for label, ts in times.items():
        med = statistics.median(ts)
        ratios = [t / b for t, b in zip(ts, base, strict=True)]
        print(
            f"{label:62s}: {n / med:8.0f} conv/s (median {med:.2f} s; runs {', '.join(f'{t:.2f}' for t in ts)}); "
            f"time / eagle3prep 2 workers: {min(ratios):.2f}-{max(ratios):.2f}x"
        )
    for line in compare(
        model, convs, tmp / f"ours-{name}", results["speculators, HTTP render stub, 1 worker"], args.max_len
    ):
        print(line)
    if args.profile:
        few = convs[: args.profile]
        few_path = tmp / "conv-few.jsonl"
        with open(conversations) as f:
            few_path.write_text("".join(f.readline() for _ in range(len(few))))
        print(f"### profile, eagle3prep tokenize, 1 process, {len(few)} conversations")
        print(profile(lambda: ours(model, few_path, tmp / "prof-ours", args.max_len, 1)))
        print(
            f"### profile, speculators' _preprocess_batch (what each datasets.map worker runs), in-process render, {len(few)} conversations"
        )
        print(profile(lambda: speculators_batch(model, few, args.max_len)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--large-vocab", type=int, default=1024)
    ap.add_argument("--profile", type=int, default=500, help="conversations per profile (0: no profile)")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from importlib.metadata import version

    from eagle3prep.prepare import prepare

    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}, "
        f"speculators {version('speculators')}, transformers {version('transformers')}, datasets {version('datasets')}, "
        f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, convs, large, src = bench_inputs(tmp, args.conversations, args.large_vocab)
        prepare([str(src)], tmp / "conv.jsonl", tmp / "q.jsonl", tmp / "counts.json")
        bench_one("demo", model, convs, tmp, args)
        bench_one(f"large ({args.large_vocab} tokens)", large, convs, tmp, args)
    print(f"# load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
