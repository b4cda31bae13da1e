"""The peer's rows for the quality bench: the same rows' hidden states made by speculators 0.9's own tool.

speculators' documented pipeline (vllm-project/speculators, docs "train" tutorial): `vllm serve` with the
`extract_hidden_states` speculative method and vLLM's ExampleHiddenStatesConnector writing each request's
states to a folder, then `speculators generate-offline-data` sending every row's token ids and moving
each file to `hidden_states/hs_{row}.safetensors`; the trainer reads them with its `file` backend.

The rows are ours (the direct export's arrow: the same input_ids and loss masks), so the draft is trained
on the same tokens and only the hidden states come from the peer. Writes OUT/wd/peer/results/export/
speculators with the arrow, vocab maps, `hidden_states/` and a manifest naming the `file` backend.

`peer_verdict` (testkit.peer_files) then judges the peer's files with the workflow's own validation: each shard of ours is
copied with its layer files rebuilt from the peer's `hs_{row}` files (token ids checked against ours),
and `validate_shard` runs the reference on every row, as for every other row of the table.
"""

from __future__ import annotations

import fcntl
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
    # not the d2t/t2d files: ours' train stage may be writing them now (run.py vocab_maps makes the peer's own)
    shutil.copytree(ours, dest, ignore=shutil.ignore_patterns("manifest.json", "hidden_states", "d2t-*", "t2d-*"))
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
        "layer_ids": layer_ids,  # the union its hs files hold; a draft reading fewer trains on peer_view's cut
        "hidden_states_backend": "file",
        "rows_from": str(ours),
        "files": len(files),
    }
    (dest / "manifest.json").write_text(json.dumps(peer_manifest, indent=1))
    return {"rc": rc, "engine_start_s": round(start_s, 1), "generate_s": round(gen_s, 1), "files": len(files)}


def peer_view(export: Path, layer_ids: list[int], reads: list[int]) -> Path:
    """hs files holding only a draft's layers (`reads`, in its order) cut from the peer's union: speculators'
    `file` backend reads every slot of a file (hidden_states[:, :-1] the aux, [:, -1] the final state). Made
    once; the seeds training side by side wait on the lock."""
    from safetensors.torch import load_file, save_file

    view = export / "views" / "_".join(map(str, reads))
    view.parent.mkdir(exist_ok=True)
    with open(view.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (view / "done").exists():
            view.mkdir(exist_ok=True)
            slots = [layer_ids.index(i) for i in reads]
            for path in sorted((export / "hidden_states").glob("hs_*.safetensors")):
                row = load_file(path)
                row["hidden_states"] = row["hidden_states"][:, slots].contiguous()  # [T, len(reads), H]
                save_file(row, view / path.name)
            (view / "done").write_text(json.dumps({"layer_ids": layer_ids, "reads": reads}))
    return view
