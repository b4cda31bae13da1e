"""The regenerate stage's own work, without a GPU: what its shard job spends outside the engine's steps.

    .venv/bin/python bench/regenerate_own_work.py OUTDIR [--prompts 1024] [--max-tokens 512] [--repeat 3]

bench/bench_regenerate.py measured on the H200 that the stage's engine steps take no longer than plain
LLM.generate, and that what (b) loses is its own work: rendering prompts, decoding replies, encoding prompt +
reply again (the re-tokenization count), writing the shard. This script times exactly that work on the same
prompts and the same 128,256-token tokenizer, with an instant engine that returns --max-tokens random ids per
request, every reply finishing at the same step (as every reply did on the H200: all cut by max_tokens).
It prints the best of --repeat runs of regenerate_shard (total = own work, the engine costing ~0) and a
cProfile of one run: where the seconds go.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from bench_regenerate import conversations, make_model  # noqa: E402

from eagle3prep.regenerate import Finished, PromptRenderer, RegenerateSettings, regenerate_shard  # noqa: E402
from eagle3prep.regenerate.split import split_conversations  # noqa: E402


class InstantEngine:
    """Takes every request, then finishes all of them in one step with `n` random ordinary ids each."""

    def __init__(self, n: int, vocab: int, specials: set[int], seed: int = 0):
        rnd = random.Random(seed)
        ordinary = [i for i in range(vocab) if i not in specials]
        self.replies = [[rnd.choice(ordinary) for _ in range(n)] for _ in range(64)]
        self.queue: list[str] = []

    def add(self, request_id, prompt_ids, seed):
        self.queue.append(request_id)

    def step(self):
        done, self.queue = self.queue, []
        return [Finished(rid, self.replies[i % 64], "length", "") for i, rid in enumerate(done)]

    def has_unfinished(self):
        return bool(self.queue)

    def abort(self, request_ids):
        self.queue = [q for q in self.queue if q not in set(request_ids)]


def run_once(model: Path, prompts: Path, out: Path, renderer: PromptRenderer, engine: InstantEngine) -> float:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    regenerate_shard(
        str(prompts), str(out), engine, renderer, RegenerateSettings.defaults(max_in_flight=4096), max_model_len=4096,
        engine_info={"engine": "instant"}, model_path=str(model), trust_remote_code=False, shard=0, code="bench",
    )  # fmt: skip
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    model = make_model(args.out, tiny=False, max_model_len=4096)
    prepared = args.out / "prepared.jsonl"
    with open(prepared, "w", encoding="utf-8") as f:
        for c in conversations(args.prompts):
            f.write(json.dumps(c) + "\n")
    prompts = args.out / "prompts" / "shard_0.jsonl"
    split_conversations(prepared, [prompts])  # the stage reads its shard's place from the split's record
    renderer = PromptRenderer.load(model)
    specials = set(renderer.tokenizer.all_special_ids)
    engine = InstantEngine(args.max_tokens, len(renderer.tokenizer), specials)

    times = [run_once(model, prompts, args.out / "shard", renderer, engine) for _ in range(args.repeat)]
    prof = cProfile.Profile()
    prof.enable()
    run_once(model, prompts, args.out / "shard", renderer, engine)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(18)
    counts = json.loads((args.out / "shard" / "counts.json").read_text())["totals"]["replies"]
    print(
        f"# {time.strftime('%Y-%m-%d')} {args.prompts} prompts x {args.max_tokens} reply tokens, 128,256-token tokenizer"
    )
    print(f"replies: {counts}")
    print(f"own work of one shard job (best of {args.repeat}): {min(times):.2f} s; all runs: "
          + ", ".join(f"{t:.2f}" for t in times))  # fmt: skip
    print(text.getvalue())


if __name__ == "__main__":
    main()
