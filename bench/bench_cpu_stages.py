"""CPU-stage benchmark: prepare + tokenize throughput against a naive per-row loop, and dry-run time.

Run from the repo root after `make demo` (needs .venv):
    .venv/bin/python bench/bench_cpu_stages.py [--conversations 8000] [--shards 10000]

Prints, in one run:
  (1) conversations/s of eagle3prep's prepare and tokenize stages on N synthetic conversations,
      against a naive one-row-at-a-time `apply_chat_template(..., return_assistant_tokens_mask=True)`
      loop over the same conversations in the same process; the ratio is the figure of merit
      (target >= 3x). Each figure is the best of --repeat runs, the naive loop's too.
      Tokenize in 1 process encodes each batch on the Rust tokenizer's own threads (one per core);
      with N workers, each worker encodes on one thread.
      Also the Rust BPE encode of the same rendered texts alone, one thread: work that the naive
      loop and eagle3prep both do, so naive time / (encode time / cores) bounds the ratio; and the
      same encode split over the cores in processes at once, the bound this machine really gives.
      Then the CPU seconds of the fastest runs (where the time goes), and the wall time of a call
      on 16 conversations (the fixed cost: worker start-up, fsyncs, stats).
      Tokenize is measured with two tokenizers, both with the demo's ChatML template:
        demo    the demo model's (512 tokens, trained on resources/demo/tokenizer_corpus.txt);
                ~2.7 characters per token, so every conversation is a long token sequence.
        large   the same byte-level BPE trained on the bench's own synthetic text with a
                --large-vocab vocabulary: ~4.5 characters of that text per token (the run prints
                it), near the ~4 usually quoted for Llama 3 or Qwen tokenizers on English.
  (2) the wall time of `snakemake -n` for a config with --shards shards (target < 30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import resource
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


def rust_encode_only(model_dir: Path, convs: list[dict]) -> tuple[float, float]:
    """(wall, CPU) seconds the Rust tokenizer alone takes to encode the rendered conversations, one thread."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = tok.apply_chat_template([c["messages"] for c in convs], tokenize=False)
    backend = tok.backend_tokenizer
    t0, c0 = time.perf_counter(), time.process_time()
    for text in texts:  # encode() of one text runs on the calling thread only
        backend.encode(text, add_special_tokens=False)
    return time.perf_counter() - t0, time.process_time() - c0


def _encode_part(model_dir: Path, texts: list[str], start_at: float) -> tuple[float, float]:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # forked: one thread, and no warning about the fork
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(model_dir).backend_tokenizer
    while time.perf_counter() < start_at:  # every process starts encoding at once, its tokenizer loaded
        time.sleep(0.001)
    t0 = time.perf_counter()
    for text in texts:
        backend.encode(text, add_special_tokens=False)
    return t0, time.perf_counter()


def rust_encode_parallel(model_dir: Path, convs: list[dict], workers: int) -> float:
    """Wall seconds of the same encode split over `workers` processes: what the cores really give together."""
    from concurrent.futures import ProcessPoolExecutor

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = tok.apply_chat_template([c["messages"] for c in convs], tokenize=False)
    parts = [texts[k::workers] for k in range(workers)]
    start_at = time.perf_counter() + 3.0  # perf_counter is CLOCK_MONOTONIC: one clock for all processes
    with ProcessPoolExecutor(workers) as pool:
        spans = list(pool.map(_encode_part, [model_dir] * workers, parts, [start_at] * workers))
    return max(end for _, end in spans) - min(start for start, _ in spans)


def chars_per_token(model_dir: Path, convs: list[dict]) -> tuple[float, float]:
    """Characters per token over the message texts alone, and over the conversations as rendered."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    backend = tok.backend_tokenizer
    contents = [m["content"] for c in convs for m in c["messages"]]
    rendered = tok.apply_chat_template([c["messages"] for c in convs], tokenize=False)

    def ratio(texts: list[str]) -> float:
        return sum(map(len, texts)) / sum(len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False))

    return ratio(contents), ratio(rendered)


def build_large_tokenizer(out_dir: Path, convs: list[dict], vocab_size: int) -> Path:
    """A tokenizer-only model folder: the demo's tokenizer recipe trained on `convs` with `vocab_size` tokens."""
    from eagle3prep.demo import build_tokenizer

    corpus = out_dir.with_suffix(".txt")
    corpus.write_text("".join(m["content"] + "\n" for c in convs for m in c["messages"]), encoding="utf-8")
    build_tokenizer(corpus, vocab_size).save_pretrained(out_dir)  # BPE training is deterministic: no seed
    return out_dir


def bench_inputs(tmp: Path, conversations: int, large_vocab: int) -> tuple[Path, list[dict], Path, Path]:
    """The demo model, `conversations` synthetic conversations, the 'large' tokenizer and the raw JSONL file."""
    from eagle3prep.demo import build_demo_model

    model = build_demo_model(tmp / "model", REPO / "resources/demo/tokenizer_corpus.txt")
    convs = synthetic_conversations(conversations)
    large = build_large_tokenizer(tmp / "large", convs, large_vocab)
    src = tmp / "raw.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return model, convs, large, src


def tokenize_into(out: Path, model_dir: Path, conversations: Path, max_seq_len: int, workers: int) -> dict:
    """The workflow's tokenize stage into `out` (4 shards); returns its stats."""
    from eagle3prep.tokenize import tokenize_conversations

    return tokenize_conversations(
        conversations, model_dir, [out / f"s{k}.jsonl" for k in range(4)], out / "stats.json", out / "freq.json",
        out / "q.jsonl", max_seq_len=max_seq_len, workers=workers, template_fallback=True, trust_remote_code=False,
        chat_template_kwargs={},
    )  # fmt: skip


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) of this process, and of its ended child processes (tokenize's workers)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime


def best_of(n: int, fn):
    """(result of the last call, least seconds over n calls, (own, children's) CPU seconds of that call)."""
    runs = []
    for _ in range(n):
        t0, (c0, k0) = time.perf_counter(), cpu_seconds()
        result = fn()
        t1, (c1, k1) = time.perf_counter(), cpu_seconds()
        runs.append((t1 - t0, (c1 - c0, k1 - k0)))
    wall, cpu = min(runs)
    return result, wall, cpu


def bench_tokenize(name: str, model: Path, convs: list[dict], conversations: Path, t_prep: float, args) -> None:
    """Print the tokenize figures of one tokenizer: naive loop, 1 and all-core processes, encode ceiling."""

    tmp = conversations.parent
    naive_rows, t_naive, (c_naive, _) = best_of(args.repeat, lambda: naive_tokenize(model, convs, 1024))

    def tokenize(workers: int, conversations: Path = conversations) -> dict:
        return tokenize_into(tmp / f"tok-{name}-{workers}", model, conversations, 1024, workers)

    workers = os.cpu_count() or 1
    _, t_tok1, (c_tok1, _) = best_of(args.repeat, lambda: tokenize(1))
    stats, t_tok, (c_parent, c_workers) = best_of(args.repeat, lambda: tokenize(workers))
    t_encode, c_encode = min(rust_encode_only(model, convs) for _ in range(args.repeat))
    t_encode_par = min(rust_encode_parallel(model, convs, workers) for _ in range(args.repeat))
    # The same calls on a few conversations: what a call costs besides its rows (start-up, fsyncs, stats).
    few = tmp / "conv-few.jsonl"
    with open(conversations) as f:
        few.write_text("".join(f.readline() for _ in range(16)))
    _, t_few1, _ = best_of(args.repeat, lambda: tokenize(1, few))
    _, t_few, _ = best_of(args.repeat, lambda: tokenize(workers, few))
    text_cpt, rendered_cpt = chars_per_token(model, convs)
    n = args.conversations
    print(
        f"## tokenizer '{name}': {stats['tokens'] / stats['rows']:.0f} tokens/row; characters per token "
        f"{text_cpt:.2f} in the message texts, {rendered_cpt:.2f} in the rendered conversations"
    )
    print(f"conversations: {n}; rows kept: ours {stats['rows']}, naive {naive_rows}; best of {args.repeat} runs")
    print(f"naive apply_chat_template loop : {n / t_naive:10.0f} conv/s ({t_naive:.2f} s)")
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
    print(
        f"Rust BPE encode alone, {workers} processes at once: {t_encode_par:.2f} s wall ({t_encode / t_encode_par:.2f}x "
        f"one thread) -> at most {t_naive / t_encode_par:.2f}x on this machine"
    )
    print(
        f"CPU seconds of the fastest runs: naive loop {c_naive:.2f}; tokenize 1 process {c_tok1:.2f} (with the Rust "
        f"encode's own threads); {workers} workers: parent {c_parent:.2f} + workers {c_workers:.2f}; encode alone "
        f"{c_encode:.2f}"
    )
    print(
        f"  -> workers - encode alone = {c_workers - c_encode:.2f} CPU s (render, parse, mask, JSON, counts, start-up, "
        f"and the encode's slowdown with every core busy); the {workers}-worker wall is {t_tok - (c_parent + c_workers) / workers:.2f} s above "
        f"(parent + workers) / {workers} cores"
    )
    print(
        f"tokenize of 16 conversations (fixed cost of a call): 1 process {t_few1:.2f} s, {workers} workers {t_few:.2f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=8000)
    ap.add_argument("--shards", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs per figure (the machine is shared)")
    ap.add_argument(
        "--large-vocab", type=int, default=1024,
        help="vocabulary of the 'large' tokenizer (the run prints how many characters a token holds)",
    )  # fmt: skip
    ap.add_argument("--dry-run-only", action="store_true", help="only (2), the dry run of --shards shards")
    args = ap.parse_args()
    from eagle3prep.prepare import prepare

    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}, "
        f"load average (1, 5, 15 min) {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not args.dry_run_only:
            bench_cpu(tmp, args, prepare)
        dry_run(tmp, args)
    # Other jobs on the machine slow the 2-worker runs most: they need every core.
    print(f"# load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


def bench_cpu(tmp: Path, args, prepare) -> None:
    """(1) prepare and tokenize throughput."""
    model, convs, large, src = bench_inputs(tmp, args.conversations, args.large_vocab)
    files = (tmp / "conv.jsonl", tmp / "q.jsonl", tmp / "counts.json")
    _, t_prep, _ = best_of(
        args.repeat, lambda: prepare([str(src)], *files, max_line_bytes=1 << 24, allow_no_user_turn=False)
    )
    n = args.conversations
    print(f"eagle3prep prepare             : {n / t_prep:10.0f} conv/s ({t_prep:.2f} s), best of {args.repeat} runs")
    bench_tokenize("demo", model, convs, tmp / "conv.jsonl", t_prep, args)
    bench_tokenize(f"large ({args.large_vocab} tokens)", large, convs, tmp / "conv.jsonl", t_prep, args)


# Snakemake's own floor for the same DAG: one tokenize job, then per shard an extract job (directory
# output, log, benchmark, conda, threads, two GPU resources, a params function, a script) and a validate
# job (the same, and a file output), and `all`; none of the workflow's code. Formatted with the shard count.
FLOOR_SNAKEFILE = """
rule all:
    input:
        expand("results/validation/shard_{{k}}.json", k=range({shards})),

rule tokenize:
    output:
        directory("results/tokenized"),
    shell:
        "mkdir -p {{output}}"

rule extract:
    input:
        tokenized="results/tokenized",
        model="model",
    output:
        directory("results/hidden_states/shard_{{k}}"),
    log:
        "logs/extract/shard_{{k}}.log",
    benchmark:
        "benchmarks/extract/shard_{{k}}.tsv"
    conda:
        "env.yaml"
    threads: 2
    resources:
        gpus=0,
        gpu=0,
    params:
        tokens=lambda w: f"results/tokenized/shard_{{w.k}}.jsonl",
    script:
        "job.py"

rule validate:
    input:
        shard="results/hidden_states/shard_{{k}}",
        tokenized="results/tokenized",
        model="model",
    output:
        "results/validation/shard_{{k}}.json",
    log:
        "logs/validate/shard_{{k}}.log",
    benchmark:
        "benchmarks/validate/shard_{{k}}.tsv"
    conda:
        "env.yaml"
    resources:
        gpus=0,
        gpu=0,
    params:
        tokens=lambda w: f"results/tokenized/shard_{{w.k}}.jsonl",
    script:
        "job.py"
"""


def dry_run(tmp: Path, args) -> None:
    """(2) Dry run of a config with many shards: DAG building must stay interactive. Timed against
    Snakemake's own floor for a DAG of the same shape (FLOOR_SNAKEFILE), in turn, best of --repeat."""
    wd = tmp / "dry"
    (wd / "config").mkdir(parents=True)
    (wd / "resources").symlink_to(REPO / "resources")
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["tokenize"]["num_shards"] = args.shards
    (wd / "config/config.yaml").write_text(yaml.safe_dump(cfg))
    floor = tmp / "floor"
    (floor / "model").mkdir(parents=True)
    (floor / "Snakefile").write_text(FLOOR_SNAKEFILE.format(shards=args.shards))
    (floor / "job.py").write_text("")
    (floor / "env.yaml").write_text("dependencies: []\n")
    snakemake = str(Path(sys.executable).with_name("snakemake"))
    runs = {"workflow": [], "floor": []}
    for _ in range(args.repeat):
        for name, cmd, cwd in (
            ("workflow", [snakemake, "--snakefile", str(REPO / "Snakefile"), "-n", "--quiet", "rules"], wd),
            ("floor", [snakemake, "-n", "--quiet", "rules"], floor),
        ):
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
            runs[name].append(time.perf_counter() - t0)
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            total = re.search(r"^total\s+(\d+)", proc.stdout + proc.stderr, re.M)  # Snakemake's own job count
            runs[name + "_jobs"] = f"{int(total.group(1))} jobs" if total else "job count not printed"
    t_dry, t_floor = min(runs["workflow"]), min(runs["floor"])
    print(
        f"snakemake -n with {args.shards} shards ({runs['workflow_jobs']}): {t_dry:.1f} s wall, best of {args.repeat}"
    )
    print(
        f"Snakemake's floor, the same DAG shape without the workflow's code ({runs['floor_jobs']}): {t_floor:.1f} s "
        f"wall, best of {args.repeat}; workflow / floor {t_dry / t_floor:.2f}"
    )
    print(
        "# every run (s): " + "; ".join(f"{k} {', '.join(f'{t:.1f}' for t in runs[k])}" for k in ("workflow", "floor"))
    )


if __name__ == "__main__":
    main()
