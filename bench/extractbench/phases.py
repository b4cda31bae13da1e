"""bench_extract's phases, each run in its own process: (a) plain vLLM prefill, (b) our vllm backend
writing shards, (c) transformers' hidden states written as the same files, (d) vLLM's own connector,
(f) (b) on the built-in path compiled, (g) (f) writing FP8."""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import threading
import time
from pathlib import Path

from eagle3prep.config.schema import SCALABLE_LOGPROB_ROWS
from extractbench.workload import image_prompts, layer_ids, tokens_of, write_tokenized

from testkit.shards import manifest_fields


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


def engine_kwargs(args, model: Path) -> dict:
    """vLLM's LLM() arguments of (a) and (d): dummy weights, no prefix caching, eager, at --tp. --images: the
    tokenizer loaded (vLLM's multimodal processor needs it, as for our backend) and no multimodal processor
    cache (IMAGE_ENGINE_ARGS)."""
    kw = dict(
        model=str(model),
        load_format="auto" if args.real_weights else "dummy",
        skip_tokenizer_init=not args.images,
        dtype=args.dtype,
        enable_prefix_caching=False,
        enforce_eager=True,
        max_model_len=args.max_len + 1,
        max_num_batched_tokens=args.batched_tokens,
        gpu_memory_utilization=args.gpu_mem,
        seed=0,
    )
    return {**kw, **(IMAGE_ENGINE_ARGS if args.images else {})}


# --images, in (a) and (b) alike: vLLM's processor cache would skip the image processor for an image seen
# before (the warm-up's, or (b)'s half shard's in its full one); each phase processes every image.
IMAGE_ENGINE_ARGS = {"mm_processor_cache_gb": 0}


def prompts(work, model: Path) -> tuple[list, int]:
    """(vLLM prompts, tokens) of one workload: rows of token ids, or (--images) a tokenized shard's rows
    with their images (image_prompts)."""
    if isinstance(work, Path):
        return image_prompts(work, model), tokens_of(work)
    return work, sum(map(len, work))


def timed_generate(llm, rows: list) -> float:
    """Seconds for one prefill (max_tokens=1) of `rows` (token ids, or prompts), after a two-row warm-up."""
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    rows = [r if isinstance(r, dict) else TokensPrompt(prompt_token_ids=r) for r in rows]
    llm.generate(rows[:2], sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate(rows, sp, use_tqdm=False)
    return time.perf_counter() - t0


def phase_a(args, model: Path, work: dict, **over) -> dict:
    """(a) plain vLLM prefill, no capture: the engine start and tokens/s per workload."""
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**{**engine_kwargs(args, model), **over})
    out = {"engine_start_s": time.perf_counter() - t0}
    for name in ("uniform", "mixed"):
        rows, tokens = prompts(work[name], model)
        out[name] = {"tokens": tokens, "tokens_per_s": tokens / timed_generate(llm, rows)}
    return out


def phase_d(args, model: Path, work: dict) -> dict:
    """(d) vLLM's extract_hidden_states with its example connector as shipped, files to /dev/shm; the
    time runs until every file's writer has let go of its lock."""
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
        **({"kv_connector_module_path": "eagle3prep.vllm.capture.builtin.cpu_connector"} if on_cpu else {}),
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


def phase_b(args, model: Path, work: dict, **over) -> dict:
    """(b) our vllm backend through extract_shard: each workload written as a shard (uniform to
    /dev/shm as well), with its bytes/s, host RSS growth and the writer's waits. `over`: extract
    settings over (b)'s (phases f and g)."""
    from eagle3prep.backends.base import CaptureSpec
    from eagle3prep.extract import extract_shard
    from eagle3prep.extract.backend import make_backend
    from eagle3prep.settings import ExtractSettings

    def settings_of(**more):
        return ExtractSettings.defaults(
            **{
                "backend": "vllm",
                "dtype": args.dtype,
                "tp_size": 1,
                "device": "cpu",
                "capture_path": args.capture_path,
                "gpu_memory_utilization": args.gpu_mem,
                "max_num_batched_tokens": args.batched_tokens,
                "enforce_eager": True,
                "engine_args": {
                    **({} if args.real_weights else {"load_format": "dummy"}),
                    **(IMAGE_ENGINE_ARGS if args.images else {}),
                },
                "storage": args.storage,  # fp8_e4m3: half the bytes (extract.storage)
                "batch_tokens": args.batch_tokens,
                # rows whose prompt logprobs vLLM computes and copies back: each syncs the engine's step
                **({} if args.logprob_rows is None else {"logprob_rows": args.logprob_rows}),
                **over,
                **more,
            }
        )

    def spec_of(settings: ExtractSettings) -> CaptureSpec:
        return CaptureSpec(settings, model_path=str(model), layer_ids=layer_ids(args.shape), max_seq_len=args.max_len)

    # the default asks no logprob rows under the full reference; the scalable reference's rows priced apart
    spec, logits_check = spec_of(settings_of()), spec_of(settings_of(logprob_rows=SCALABLE_LOGPROB_ROWS))
    shards = args.out / "shards"
    shm = Path("/dev/shm")
    t0 = time.perf_counter()
    backend = make_backend(spec)
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
        # the uniform shard again with the scalable reference's logits-check rows (their prompt logprobs)
        runs += [("uniform_lp", shards)]
        # the mixed shard once more: growth that repeats grows with the shards; a first shard's own is the allocators'
        runs += [("mixed_again", shards)]
        for name, where in runs:
            rows = work[name.removesuffix("_shm").removesuffix("_lp").removesuffix("_again")]  # --images: tokenized
            tok = rows if isinstance(rows, Path) else write_tokenized(args.out / f"{name}.jsonl", rows)
            base = rss.reset()
            m = extract_shard(
                str(tok),
                str(where / name),
                logits_check if name.endswith("_lp") else spec,
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
    """(c) transformers' output_hidden_states, the same layers copied to the host through LayerSink
    and written by ShardWriter as the same files."""
    import torch
    import transformers

    from eagle3prep.extract import iter_batches
    from eagle3prep.shard.formats import storage_format
    from eagle3prep.shard.readers import index_of_tokenized
    from eagle3prep.shard.sink import LayerSink, Segment, SinkPlan
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
        index = index_of_tokenized(tok)
        model_dtype = storage_format("model_dtype")
        writer = ShardWriter(args.out / f"hf_{name}", ids, cfg.hidden_size, args.dtype, index, storage=model_dtype)
        sink = LayerSink(writer.sink_spec(SinkPlan(args.hf_batch_tokens, 3, "row")))
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
        # a baseline: no provenance
        placeholders = manifest_fields(num_hidden_layers=n, hidden_size=cfg.hidden_size, dtype=args.dtype)
        writer.finish(sink.finish(), placeholders)
        secs = time.perf_counter() - t1
        out[name] = {
            "tokens": sum(lens for lens in map(len, work[name])),
            "tokens_per_s": sum(map(len, work[name])) / secs,
        }
        shutil.rmtree(args.out / f"hf_{name}")
    return out


def phase_f(args, model: Path, work: dict) -> dict:
    """(f) (b) on the built-in path (extract_hidden_states + our connector writing from the worker), the
    engine compiled as vLLM starts by default: nothing there needs eager mode, unlike the hooks."""
    return phase_b(args, model, work, capture_path="builtin", enforce_eager=False)


def phase_p(args, model: Path, work: dict) -> dict:
    """(p) (a) compiled, as vLLM starts by default: the like-for-like baseline of (f), whose engine is compiled
    too (a user's plain prefill is compiled unless they ask for eager)."""
    return phase_a(args, model, work, enforce_eager=False)


def phase_e(args, model: Path, work: dict) -> dict:
    """(e) (p) with vLLM's extract_hidden_states and our connector, compiled, but no shard open: the layers are
    kept in vLLM's buffer and nothing is gathered, copied or written. What vLLM's method costs by itself; f/e is
    then what our gather and writer add."""
    from eagle3prep.vllm.capture.builtin.path import BuiltinPath

    kw = BuiltinPath(layer_ids(args.shape), version="").engine_kwargs()
    kw.pop("worker_extension_cls")  # no sink attached: the connector finds no shard open and gathers nothing
    return phase_a(args, model, work, enforce_eager=False, **kw)


def phase_g(args, model: Path, work: dict) -> dict:
    """(g) (f) writing a scaled storage (--scaled, default fp8_e4m3; encoded in the worker): fewer bytes."""
    return phase_b(args, model, work, capture_path="builtin", enforce_eager=False, storage=args.scaled)


PHASES = {
    "a": phase_a, "b": phase_b, "c": phase_c, "d": phase_d, "e": phase_e, "f": phase_f, "g": phase_g, "p": phase_p,
}  # fmt: skip
