"""The quality bench's planted rows: ours' data made wrong as a careless pipeline writes it.

Source: the variant `all_ids` (the same rows as `ours`, every id 1..N captured, validated). For each
mistake, `testkit.planted` writes a shard with the default ids [2, N/2, N-3, N] whose manifest
checksums agree with its files (so only the reference check can tell), and:
  1. the workflow's own validation judges it (`validate_shard`, the reference on every row): its verdict
     is a column of the table;
  2. it is exported for speculators as a pipeline without validation would export it: the export's
     validation input is a record that says so (`"ok": true, "careless": true`), since
     `export_speculators` takes only validated shards;
  3. OUT/wd/planted_<mistake>/results/export/speculators is then trained and served like any variant,
     the draft keeping the right ids (the export's manifest names them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MISTAKES = {
    "planted_layer_plus_one": "layer_plus_one",  # every auxiliary id k holds k + 1; the draft's ids stay right
    "planted_post_norm_final": "post_norm_final",  # the last slot holds the final norm's output
    "planted_tokens_shifted": "tokens_shifted",  # every row's states one token early against its ids
}


def final_norm(model_path: Path):
    """The target's final RMSNorm as a function of [T, H] states (for post_norm_final)."""
    import torch
    from transformers import AutoModelForCausalLM

    norm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).model.norm.eval()

    def apply(hs):
        with torch.no_grad():
            return norm(hs.float())

    return apply


def plant_variant(out: Path, variant: str, device: str) -> dict:
    """Write the planted variant's shard, its validation verdict and its careless export."""
    from eagle3prep.export import export_speculators
    from eagle3prep.shard.manifest import read_manifest
    from eagle3prep.validate import ValidationError, validate_shard

    from testkit.planted import plant

    src_wd, wd = out / "wd/all_ids", out / "wd" / variant
    source = src_wd / "results/hidden_states/shard_0"
    n = read_manifest(source).num_hidden_layers
    ids = sorted({min(2, n - 1), n // 2, max(n - 3, 1), n})  # the default ids; on the toy's 2 layers [1, 2]
    model = out / "target/model"
    shutil.rmtree(wd, ignore_errors=True)
    shard = wd / "results/hidden_states/shard_0"
    shard.parent.mkdir(parents=True)
    plant(MISTAKES[variant], source, shard, ids, final_norm=final_norm(model))
    tokenized = src_wd / "results/tokenized/shard_0.jsonl"
    verdict_json = wd / "results/validation/shard_0.json"
    verdict_json.parent.mkdir(parents=True)
    try:
        validate_shard(str(shard), str(tokenized), str(verdict_json), str(model), sample_rows=10**9, seed=0,
                       device=device, reference=True, trust_remote_code=False, windows=None)  # fmt: skip
        verdict = "PASS"
    except ValidationError as e:
        verdict = f"FAIL: {str(e).splitlines()[0][:300]}"
    careless = wd / "results/validation/careless.json"
    careless.write_text(json.dumps({"ok": True, "careless": True, "shard_dir": str(shard)}))
    export_speculators(
        [str(shard)],
        [str(careless)],
        [str(tokenized)],
        str(src_wd / "results/tokenized/token_freq.json"),
        str(wd / "results/export/speculators"),
        hidden_states="direct",
    )
    return {"mistake": MISTAKES[variant], "layer_ids": ids, "validation": verdict}
