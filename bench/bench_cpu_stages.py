"""CPU-stage benchmark: prepare + tokenize throughput against a naive per-row loop, and dry-run time.

Run from the repo root after `make demo` (needs .venv):
    .venv/bin/python bench/bench_cpu_stages.py [--conversations 8000] [--shards 10000]

Prints, in one run:
  (1) conversations/s of eagle3prep's prepare and tokenize stages on N synthetic conversations,
      against a naive one-row-at-a-time `apply_chat_template(..., return_assistant_tokens_mask=True)`
      loop over the same conversations in the same process; the ratio is the figure of merit
      (target >= 3x). Each figure is the best of --repeat runs, the naive loop's too.
      Also the Rust BPE encode of the same rendered texts alone, one thread: work that the naive
      loop and eagle3prep both do, so naive time / (encode time / cores) bounds the ratio.
  (2) the wall time of `snakemake -n` for a config with --shards shards (target < 30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def synthetic_conversations(n: int, seed: int = 0) -> list[dict]:
    """Multi-turn OpenAI-shape conversations of varied length (words from the demo corpus)."""
    words = (REPO / "resources/demo/tokenizer_corpus.txt").read_text().split()
    rnd = random.Random(seed)

    def text(lo, hi):
        return " ".join(rnd.choice(words) for _ in range(rnd.randint(lo, hi)))

    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": text(5, 20)}] if i % 3 == 0 else []
        for _ in range(rnd.randint(1, 4)):
            msgs += [{"role": "user", "content": text(5, 60)}, {"role": "assistant", "content": text(10, 120)}]
        out.append({"messages": msgs})
    return out


def naive_tokenize(model_dir: Path, convs: list[dict], max_seq_len: int) -> int:
    """The baseline: what most glue scripts do, one conversation per call."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    n = 0
    for c in convs:
        enc = tok.apply_chat_template(
            c["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = enc["input_ids"][:max_seq_len], enc["assistant_masks"][:max_seq_len]
        n += len(ids) > 0 and any(mask)
    return n


def rust_encode_only(model_dir: Path, convs: list[dict]) -> float:
    """Seconds the Rust tokenizer alone takes to encode the rendered conversations, one thread."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = tok.apply_chat_template([c["messages"] for c in convs], tokenize=False)
    backend = tok.backend_tokenizer
    t0 = time.perf_counter()
    for text in texts:  # encode() of one text runs on the calling thread only
        backend.encode(text, add_special_tokens=False)
    return time.perf_counter() - t0


def best_of(n: int, fn):
    """(result of the last call, least seconds over n calls)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return result, min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=8000)
    ap.add_argument("--shards", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs per figure (the machine is shared)")
    args = ap.parse_args()
    from eagle3prep.demo import build_demo_model
    from eagle3prep.prepare import prepare
    from eagle3prep.tokenization import tokenize_conversations

    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_demo_model(tmp / "model", REPO / "resources/demo/tokenizer_corpus.txt")
        convs = synthetic_conversations(args.conversations)
        src = tmp / "raw.jsonl"
        src.write_text("".join(json.dumps(c) + "\n" for c in convs))

        naive_rows, t_naive = best_of(args.repeat, lambda: naive_tokenize(model, convs, 1024))
        _, t_prep = best_of(
            args.repeat, lambda: prepare([str(src)], tmp / "conv.jsonl", tmp / "q.jsonl", tmp / "counts.json")
        )

        def tokenize(workers: int) -> dict:
            out = tmp / f"tok{workers}"
            return tokenize_conversations(
                tmp / "conv.jsonl",
                model,
                [out / f"s{k}.jsonl" for k in range(4)],
                out / "stats.json",
                out / "freq.json",
                out / "tq.jsonl",
                max_seq_len=1024,
                workers=workers,
            )

        workers = os.cpu_count() or 1
        _, t_tok1 = best_of(args.repeat, lambda: tokenize(1))
        stats, t_tok = best_of(args.repeat, lambda: tokenize(workers))
        t_encode = min(rust_encode_only(model, convs) for _ in range(args.repeat))
        n = args.conversations
        print(f"conversations: {n}; rows kept: ours {stats['rows']}, naive {naive_rows}; best of {args.repeat} runs")
        print(f"naive apply_chat_template loop : {n / t_naive:10.0f} conv/s ({t_naive:.2f} s)")
        print(f"eagle3prep prepare             : {n / t_prep:10.0f} conv/s ({t_prep:.2f} s)")
        print(f"eagle3prep tokenize, 1 process : {n / t_tok1:10.0f} conv/s ({t_tok1:.2f} s)")
        print(f"eagle3prep tokenize, {workers} workers : {n / t_tok:10.0f} conv/s ({t_tok:.2f} s)")
        print(
            f"eagle3prep prepare + tokenize  : {n / (t_prep + t_tok):10.0f} conv/s "
            f"-> {t_naive / (t_prep + t_tok):.2f}x the naive loop (tokenize alone {t_naive / t_tok:.2f}x)"
        )
        print(
            f"Rust BPE encode alone, 1 thread: {n / t_encode:10.0f} conv/s ({t_encode:.2f} s, "
            f"{t_encode / t_naive:.0%} of the naive loop) -> at most {t_naive / (t_encode / workers):.2f}x "
            f"on {workers} cores"
        )

        # (2) Dry run of a config with many shards: DAG building must stay interactive.
        wd = tmp / "dry"
        (wd / "config").mkdir(parents=True)
        (wd / "resources").symlink_to(REPO / "resources")
        cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
        cfg["tokenize"]["num_shards"] = args.shards
        (wd / "config/config.yaml").write_text(yaml.safe_dump(cfg))
        snakemake = str(Path(sys.executable).with_name("snakemake"))
        t0 = time.perf_counter()
        proc = subprocess.run(
            [snakemake, "--snakefile", str(REPO / "Snakefile"), "-n", "--quiet", "rules"],
            cwd=wd,
            capture_output=True,
            text=True,
        )
        t_dry = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
        print(f"snakemake -n with {args.shards} shards ({3 * args.shards + 5} jobs): {t_dry:.1f} s wall")


if __name__ == "__main__":
    main()
