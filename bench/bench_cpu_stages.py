"""CPU-stage benchmark: prepare + tokenize throughput against a naive per-row loop, and dry-run time.

Run from the repo root after `make demo` (needs .venv):
    .venv/bin/python bench/bench_cpu_stages.py [--conversations 8000] [--shards 10000]

Prints, in one run:
  (1) conversations/s of eagle3prep's prepare and tokenize stages on N synthetic conversations,
      against a naive one-row-at-a-time `apply_chat_template(..., return_assistant_tokens_mask=True)`
      loop over the same conversations in the same process; the ratio is the figure of merit
      (target >= 3x).
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=8000)
    ap.add_argument("--shards", type=int, default=10000)
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

        t0 = time.perf_counter()
        naive_rows = naive_tokenize(model, convs, 1024)
        t_naive = time.perf_counter() - t0

        t0 = time.perf_counter()
        prepare([str(src)], tmp / "conv.jsonl", tmp / "q.jsonl", tmp / "counts.json")
        t_prep = time.perf_counter() - t0

        def tokenize(workers: int) -> tuple[dict, float]:
            t0 = time.perf_counter()
            out = tmp / f"tok{workers}"
            stats = tokenize_conversations(
                tmp / "conv.jsonl",
                model,
                [out / f"s{k}.jsonl" for k in range(4)],
                out / "stats.json",
                out / "freq.json",
                out / "tq.jsonl",
                max_seq_len=1024,
                workers=workers,
            )
            return stats, time.perf_counter() - t0

        workers = os.cpu_count() or 1
        _, t_tok1 = tokenize(1)
        stats, t_tok = tokenize(workers)
        n = args.conversations
        print(f"conversations: {n}; rows kept: ours {stats['rows']}, naive {naive_rows}")
        print(f"naive apply_chat_template loop : {n / t_naive:10.0f} conv/s ({t_naive:.2f} s)")
        print(f"eagle3prep prepare             : {n / t_prep:10.0f} conv/s ({t_prep:.2f} s)")
        print(f"eagle3prep tokenize, 1 process : {n / t_tok1:10.0f} conv/s ({t_tok1:.2f} s)")
        print(f"eagle3prep tokenize, {workers} workers : {n / t_tok:10.0f} conv/s ({t_tok:.2f} s)")
        print(
            f"eagle3prep prepare + tokenize  : {n / (t_prep + t_tok):10.0f} conv/s "
            f"-> {t_naive / (t_prep + t_tok):.2f}x the naive loop (tokenize alone {t_naive / t_tok:.2f}x)"
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
