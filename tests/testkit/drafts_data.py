"""One dataset for several drafts: a tiny target's rows captured once at the union of the drafts' layers
(layers.drafts resolved as the workflow resolves them), validated and exported `direct`, as the workflow's rules
leave it; tests/test_draft_views.py trains every draft from it.

The target is tiny_models' Qwen3 with a native MTP head (`mtp.*` tensors, Qwen3-Next's layout, random like the
rest): speculators 0.9.0 trains MTP only from a verifier whose model type its MTP layers know (qwen3, qwen3_next,
qwen3_5_text, qwen3_5_moe_text: "Unsupported MTP model type 'llama'" otherwise) and whose checkpoint holds the head
(MTPConverter extracts `mtp.*`). transformers loads the target without the head (unexpected keys are dropped)."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

from eagle3prep.drafts import ALGORITHMS, capture_layer_ids, resolve_drafts
from eagle3prep.export import export_speculators
from eagle3prep.extract import extract_shard
from eagle3prep.settings import ExtractSettings
from eagle3prep.shard.tokenized import rows as tokenized_rows

from testkit import calls
from testkit.shards import demo_spec, with_settings, write_tokenized
from testkit.tiny_models import NUM_LAYERS, build_family

N = NUM_LAYERS
# One of every draft type speculators 0.9.0 trains; dflash's ids in the published numbering (output of layer i).
DRAFTS = [
    {"type": "eagle3"},
    {"type": "peagle"},
    {"type": "dflash", "ids": [0, 2, 4], "convention": "output_of_layer"},
    {"type": "dflash2", "ids": [1, 3, 5]},
    {"type": "dspark", "ids": [1, 3, 5]},
    {"type": "xpress", "ids": [1, 3, 5]},
    {"type": "mtp"},
]
TYPES = ALGORITHMS
LENGTHS = [[64, 48, 80, 56], [72, 40, 64]]  # two shards of rows
EPOCHS = 4


def add_mtp_head(model_dir: Path, seed: int = 1) -> None:
    """Write a random native MTP head into the target's checkpoint: one Qwen3 decoder layer (`mtp.layers.0.*`), the
    projection of [embedding, hidden] (`mtp.fc`) and its norms, the keys speculators' MTPConverter maps."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    layer = Qwen3DecoderLayer(config, 0)
    h = config.hidden_size
    head = {f"mtp.layers.0.{k}": v.detach().clone() for k, v in layer.state_dict().items()}
    head |= {"mtp.fc.weight": torch.randn(h, 2 * h) * 0.05}
    head |= {f"mtp.{k}.weight": torch.ones(h) for k in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding")}
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    save_file({**weights, **{k: v.to(next(iter(weights.values())).dtype).contiguous() for k, v in head.items()}},
              path, metadata={"format": "pt"})  # fmt: skip


def build(root: Path) -> dict:
    """{"model", "export", "layer_ids", "drafts", "shards"}: the dataset under `root`, captured once."""
    model_dir = build_family("qwen3", root / "qwen3_mtp")
    add_mtp_head(model_dir)
    ids = capture_layer_ids(None, "input_of_layer", DRAFTS, N)
    res = root / "results"
    (res / "tokenized").mkdir(parents=True)
    freq: Counter[int] = Counter()
    first, shards = 0, []
    for k, lengths in enumerate(LENGTHS):
        tok = write_tokenized(res / f"tokenized/shard_{k}.jsonl", lengths, seed=10 + k, first_row=first)
        shard = res / f"hidden_states/shard_{k}"
        spec = with_settings(replace(demo_spec(model_dir), layer_ids=ids), ExtractSettings.defaults(batch_tokens=256))
        extract_shard(str(tok), str(shard), spec, shard=k)
        calls.validate(shard, tok, res / f"validation/shard_{k}.json", model_dir, reference=False)
        for r in tokenized_rows(tok):
            freq.update(t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m)
        first += len(lengths)
        shards.append(k)
    (res / "tokenized/token_freq.json").write_text(json.dumps({str(t): c for t, c in sorted(freq.items())}))
    inputs = {
        "shard_dirs": [str(res / f"hidden_states/shard_{k}") for k in shards],
        "validations": [f"results/validation/shard_{k}.json" for k in shards],
        "tokenized": [f"results/tokenized/shard_{k}.jsonl" for k in shards],
        "token_freq_json": "results/tokenized/token_freq.json",
    }
    with contextlib.chdir(root):  # validations name their shards relative to the workflow's folder
        export_speculators(**inputs, out_dir=str(res / "export/speculators"), hidden_states="direct")
    return {"model": model_dir, "export": res / "export/speculators", "layer_ids": ids,
            "drafts": resolve_drafts(DRAFTS, N),
            "shards": [res / f"hidden_states/shard_{k}" for k in shards]}  # fmt: skip
