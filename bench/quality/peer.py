"""The peer's rows for the quality bench: the same rows' hidden states made by speculators 0.9's own tool.

speculators' documented pipeline (vllm-project/speculators, docs "train" tutorial): `vllm serve` with the
`extract_hidden_states` speculative method and vLLM's ExampleHiddenStatesConnector writing each request's
states to a folder, then `speculators generate-offline-data` sending every row's token ids and moving
each file to `hidden_states/hs_{row}.safetensors`; the trainer reads them with its `file` backend.

The rows are ours (the direct export's arrow: the same input_ids and loss masks), so the draft is trained
on the same tokens and only the hidden states come from the peer. Writes OUT/wd/peer/results/export/
speculators with the arrow, vocab maps, `hidden_states/` and a manifest naming the `file` backend.

`peer_verdict` then judges the peer's files with the workflow's own validation: each shard of ours is
copied with its layer files rebuilt from the peer's `hs_{row}` files (token ids checked against ours),
and `validate_shard` runs the reference on every row, as for every other row of the table.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PORT = 8011


def _wait_for_server(proc: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} before it answered")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"vllm serve did not answer in {timeout} s")


def serve_command(model: Path, layer_ids: list[int], staging: Path) -> list[str]:
    """vllm serve as speculators' launch script configures it (extract_hidden_states + the example connector)."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    kv = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(staging)},
    }
    return [
        *(sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--port", str(PORT)),
        *("--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)),
        *("--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", str(4 << 30)),  # shares the GPU
        *("--max-model-len", "4096", "--no-enable-prefix-caching"),
    ]


def make_peer(out: Path) -> dict:
    ours = out / "wd/ours/results/export/speculators"
    manifest = json.loads((ours / "manifest.json").read_text())
    # Every id the trainer reads, the final state's N included (speculators' launch_vllm.py
    # --include-last-layer): with the auxiliary ids alone vLLM writes 3 of 4 layers, --validate-outputs
    # passes them, and the trainer stops on a shape mismatch (H200, 2026-12-02).
    layer_ids = manifest["layer_ids"]
    dest = out / "wd/peer/results/export/speculators"
    shutil.rmtree(out / "wd/peer", ignore_errors=True)  # a rerun starts over: staging, logs, export
    shutil.copytree(ours, dest, ignore=shutil.ignore_patterns("manifest.json", "hidden_states"))
    staging = out / "wd/peer/staging"
    staging.mkdir(parents=True)
    t0 = time.time()
    with open(out / "wd/peer/vllm_serve.log", "w") as log:
        server = subprocess.Popen(serve_command(out / "target/model", layer_ids, staging), stdout=log, stderr=log)
        try:
            _wait_for_server(server)
            start_s = time.time() - t0
            t1 = time.time()
            gen = [sys.executable, "-m", "speculators", "generate-offline-data", "--model", str(out / "target/model")]
            gen += ["--endpoint", f"http://127.0.0.1:{PORT}/v1", "--preprocessed-data", str(dest)]
            gen += ["--output", str(dest / "hidden_states"), "--validate-outputs", "--fail-on-error"]
            with open(out / "wd/peer/generate_offline_data.log", "w") as glog:
                rc = subprocess.run(gen, stdout=glog, stderr=glog).returncode
            gen_s = time.time() - t1
        finally:
            server.terminate()
            server.wait(timeout=60)
    files = sorted((dest / "hidden_states").glob("hs_*.safetensors")) if rc == 0 else []
    peer_manifest = {
        "format": "eagle3prep.quality_peer/1",
        "made_by": "speculators generate-offline-data + vllm serve extract_hidden_states",
        "target_layer_ids": manifest["target_layer_ids"],
        "hidden_states_backend": "file",
        "rows_from": str(ours),
        "files": len(files),
    }
    (dest / "manifest.json").write_text(json.dumps(peer_manifest, indent=1))
    return {"rc": rc, "engine_start_s": round(start_s, 1), "generate_s": round(gen_s, 1), "files": len(files)}


def peer_shard(out: Path, source: Path, dest: Path) -> Path:
    """`dest`: shard `source` of ours with every layer file rebuilt from the peer's hs_{row} files."""
    import torch
    from safetensors.torch import load_file

    from eagle3prep.shard.layout import layer_file
    from eagle3prep.shard.manifest import read_manifest
    from eagle3prep.shard.readers import read_index
    from eagle3prep.testing.planted import rewrite_manifest
    from eagle3prep.testing.writers import write_layer

    peer_files = out / "wd/peer/results/export/speculators/hidden_states"
    manifest = read_manifest(source)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("layer_*.safetensors", "manifest.json"))
    token_ids = load_file(str(source / "token_ids.safetensors"))["token_ids"]  # [sum_T] int64
    per_layer: list[list] = [[] for _ in manifest.layer_ids]
    for e in read_index(source):
        path = peer_files / f"hs_{e.row}.safetensors"
        if not path.is_file():
            raise SystemExit(f"error: {path} is missing: the peer wrote no hidden states for ours' row {e.row}")
        peer = load_file(str(path))  # token_ids [T], hidden_states [T, L, H]
        if not torch.equal(peer["token_ids"], token_ids[e.offset : e.offset + e.length]):
            raise SystemExit(f"error: peer's hs_{e.row}.safetensors holds other token ids than ours' row {e.row}")
        for j in range(len(manifest.layer_ids)):  # the peer's L follows the ids it was served with: ours' order
            per_layer[j].append(peer["hidden_states"][:, j])
    for lid, parts in zip(manifest.layer_ids, per_layer, strict=True):
        write_layer(dest / layer_file(lid), torch.cat(parts), manifest.storage_name)
    return rewrite_manifest(dest, manifest, manifest.layer_ids)


def peer_verdict(out: Path, device: str) -> dict:
    """The workflow's validation (the reference on every row) on the peer's hidden states, shard by shard."""
    from eagle3prep.validate import ValidationError, validate_shard

    ours = out / "wd/ours/results"
    verdicts = {}
    for source in sorted((ours / "hidden_states").glob("shard_*")):
        shard = out / "wd/peer/results/hidden_states" / source.name
        peer_shard(out, source, shard)
        report = out / "wd/peer/results/validation" / f"{source.name}.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        tokenized = ours / "tokenized" / f"{source.name}.jsonl"
        try:
            validate_shard(str(shard), str(tokenized), str(report), str(out / "target/model"), 10**9, device=device)
            verdicts[source.name] = "PASS"
        except ValidationError as e:
            verdicts[source.name] = f"FAIL: {str(e).splitlines()[0][:300]}"
    return verdicts
