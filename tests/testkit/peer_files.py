"""Another tool's per-row hidden-state files judged by the workflow's own validation (the quality bench's peer:
speculators' generate-offline-data, bench/quality/peer.py).

The peer writes `hs_{row}.safetensors` (token_ids [T], hidden_states [T, L, H], L in the order of the ids it was
served with) under OUT/wd/peer/results/export/speculators/hidden_states, for the rows of ours' run in
OUT/wd/ours/results. Each shard of ours is copied with its layer files rebuilt from those files (token ids checked
against ours), and validate_shard runs the reference on every row against OUT/target/model.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def peer_shard(out: Path, source: Path, dest: Path) -> Path:
    """`dest`: shard `source` of ours with every layer file rebuilt from the peer's hs_{row} files."""
    import torch
    from safetensors.torch import load_file

    from eagle3prep.shard.layout import layer_file
    from eagle3prep.shard.manifest import read_manifest
    from eagle3prep.shard.readers import read_index

    from testkit.planted import rewrite_manifest
    from testkit.writers import write_layer

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
            validate_shard(
                str(shard),
                str(tokenized),
                str(report),
                str(out / "target/model"),
                10**9,
                device=device,
                seed=0,
                reference=True,
                trust_remote_code=False,
                windows=None,
            )
            verdicts[source.name] = "PASS"
        except ValidationError as e:
            verdicts[source.name] = f"FAIL: {str(e).splitlines()[0][:300]}"
    return verdicts
