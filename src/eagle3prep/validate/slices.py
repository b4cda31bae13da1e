"""A slice of a checkpoint: its config, tensors loaded by name, and single decoder layers built from them.

Used by the scalable checks (validate/window.py, validate/logits.py) for targets too large for a full transformers forward: one
decoder layer, or the final norm and lm_head, is read with safetensors' `safe_open` and placed into
transformers' own module classes, built on the meta device so nothing else is allocated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def raw_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json as a dict, with a nested `text_config` (multimodal wrappers such as Kimi-K2.5) lifted out.

    The wrapper's `quantization_config` is carried into the text config, since it covers the text weights.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if "text_config" in cfg:
        text = dict(cfg["text_config"])
        if "quantization_config" in cfg:
            text.setdefault("quantization_config", cfg["quantization_config"])
        return text
    return cfg


def hf_config(raw: dict[str, Any]):
    """A transformers config object for the text model: by its model_type, else by its architecture class."""
    import transformers
    from transformers import CONFIG_MAPPING

    kwargs = {k: v for k, v in raw.items() if k not in ("quantization_config", "auto_map", "model_type")}
    if raw.get("model_type") in CONFIG_MAPPING:
        config = CONFIG_MAPPING[raw["model_type"]](**kwargs)
    else:  # e.g. Kimi's "kimi_k2" text config, whose architecture is DeepseekV3ForCausalLM
        arch = next((a for a in raw.get("architectures", []) if hasattr(transformers, a)), None)
        if arch is None:
            raise ValueError(
                f"no transformers class for model_type {raw.get('model_type')!r} / {raw.get('architectures')}"
            )
        config = getattr(transformers, arch).config_class(**kwargs)
    config._attn_implementation = "sdpa"  # with no mask, sdpa is causal (the module's is_causal)
    return config


class Checkpoint:
    """A model folder's config and tensor index; tensors are read by name, one file handle at a time."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.raw = raw_config(self.dir)
        self.config = hf_config(self.raw)
        index = self.dir / INDEX
        if index.is_file():
            self.files = json.loads(index.read_text())["weight_map"]
        elif (self.dir / SINGLE).is_file():
            from safetensors import safe_open

            with safe_open(self.dir / SINGLE, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), SINGLE)
        else:
            raise FileNotFoundError(f"{self.dir}: neither {INDEX} nor {SINGLE}")
        # The text model's names may sit under a wrapper's prefix ("language_model.model.layers.0...").
        m = next((re.match(r"^(.*?)model\.layers\.\d+\.", n) for n in self.files if ".layers." in n), None)
        self.prefix = m.group(1) if m else ""
        self._skeleton = None
        self._handles: dict[str, Any] = {}

    def names(self, prefix: str) -> list[str]:
        return sorted(n for n in self.files if n.startswith(prefix))

    def _get(self, name: str):
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._handles:  # kept open: a MoE layer is thousands of tensors in a few files
            self._handles[file] = safe_open(self.dir / file, framework="pt")
        return self._handles[file].get_tensor(name)

    def loaders(self, prefix: str) -> dict[str, Any]:
        """{name without `prefix`: a function reading that tensor} for every tensor under `prefix`."""
        out = {n[len(prefix) :]: (lambda n=n: self._get(n)) for n in self.names(prefix)}
        if not out:
            raise KeyError(f"{self.dir}: no tensor named {prefix}*")
        return out

    def load(self, prefix: str) -> dict[str, Any]:
        """{name without `prefix`: tensor} of every tensor whose name starts with `prefix`, as stored."""
        return {n: f() for n, f in self.loaders(prefix).items()}

    @property
    def skeleton(self):
        """The whole causal-LM module tree on the meta device (no memory): the source of every module class."""
        if self._skeleton is None:
            import torch
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                try:
                    self._skeleton = AutoModelForCausalLM.from_config(self.config)
                except ValueError:  # a VLM's text config (qwen2_5_vl_text) has no causal-LM class of its own
                    self._skeleton = text_skeleton(self.config)
        return self._skeleton

    def _keep_fp32(self) -> list[str]:
        m = self.skeleton
        return list(getattr(m, "_keep_in_fp32_modules_strict", None) or []) + list(
            getattr(m, "_keep_in_fp32_modules", None) or []
        )

    def module(self, path: str, tensors: dict[str, Any], dtype):
        """A copy of the skeleton's submodule at `path` ("model.layers.5") holding `tensors` (assign=True), in `dtype`.

        A copy, so two precisions of one module can coexist; dropping it frees its weights.
        """
        import copy

        module = copy.deepcopy(self.skeleton.get_submodule(path))
        module.load_state_dict(tensors, strict=True, assign=True)
        left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if left:
            raise ValueError(f"{path}: no weights for {left[:5]}")
        return cast(module, dtype, self._keep_fp32())

    def layer(self, k: int, dtype):
        """Decoder layer k with its weights (dequantized, experts fused the way transformers fuses them).

        Each tensor is read, dequantized and cast to `dtype` on demand, so the per-expert copies are
        transient and the layer is held once, fused, in `dtype`.
        """
        loaders = dequantize(self.loaders(f"{self.prefix}model.layers.{k}."), self.raw.get("quantization_config"))
        keep = self._keep_fp32()
        loaders = {n: _cast_loader(f, dtype, any(x in n for x in keep)) for n, f in loaders.items()}
        return self.module(f"model.layers.{k}", fuse_experts(loaders, self.config.model_type), dtype)

    def head(self, dtype):
        """(final norm, lm_head) with their weights; a tied lm_head reads the embedding."""
        norm = self.module("model.norm", self.load(f"{self.prefix}model.norm."), dtype)
        name = f"{self.prefix}lm_head."
        if not self.names(name):
            name = f"{self.prefix}model.embed_tokens."
        return norm, self.module("lm_head", self.load(name), dtype)

    def rotary(self):
        """The model's own rotary embedding (e.g. DeepSeek's yarn), built for real: its tables are computed."""
        return type(self.skeleton.model.rotary_emb)(config=self.config)

    def close(self) -> None:
        """Close the open checkpoint files (reopened on the next read)."""
        self._handles.clear()


def as_checkpoint(model) -> Checkpoint:
    """`model` (a model folder, or a Checkpoint the caller keeps open across checks) as a Checkpoint."""
    return model if isinstance(model, Checkpoint) else Checkpoint(model)


def torch_dtype(name):
    """A torch dtype from its name ("bfloat16"); a torch dtype is returned as it is."""
    import torch

    return getattr(torch, name) if isinstance(name, str) else name


def text_skeleton(config):
    """The causal-LM tree (`model` = the text model, `lm_head`) of a text config that only a VLM wraps: the
    module paths Checkpoint asks for ("model.layers.5", "model.norm", "lm_head"), as its checkpoint names them."""
    import torch
    from transformers import AutoModel

    skeleton = torch.nn.Module()
    skeleton.model = AutoModel.from_config(config)
    skeleton.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    return skeleton


def _cast_loader(load, dtype, keep_fp32: bool):
    def go():
        t = load()
        return t if not t.is_floating_point() else t.float() if keep_fp32 else t.to(dtype)

    return go


def cast(module, dtype, keep_fp32: list[str]):
    """`module` in `dtype`, except tensors the model class keeps in fp32 (DeepSeek's e_score_correction_bias)."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_floating_point() and not any(k in name for k in keep_fp32):
            t.data = t.data.to(dtype)
        elif t.is_floating_point():
            t.data = t.data.float()
    return module


def dequantize(loaders: dict[str, Any], quantization_config: dict[str, Any] | None) -> dict[str, Any]:
    """Loaders with every compressed-tensors pack-quantized module (weight_packed/_scale/_shape) as one `weight`.

    compressed-tensors' own decompressor does the unpacking and the group scales, in fp32 (int4 x a
    bf16 scale is exact there, not always in bf16); the caller casts to the working precision.
    """
    packed = [n[: -len(".weight_packed")] for n in loaders if n.endswith(".weight_packed")]
    if not packed:
        return loaders
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(quantization_config)
    if qc.format != "pack-quantized" or len(qc.config_groups) != 1:
        raise ValueError(
            f"only one pack-quantized config group is supported, not {qc.format} {list(qc.config_groups)}"
        )
    scheme = next(iter(qc.config_groups.values()))
    out = dict(loaders)

    def weight(parts: dict[str, Any]):
        local = {k: f() for k, f in parts.items()}
        local["weight_scale"] = local["weight_scale"].float()
        return PackedQuantizationCompressor.decompress(local, scheme)["weight"]

    for m in packed:
        parts = {k[len(m) + 1 :]: out.pop(k) for k in [k for k in out if k.startswith(m + ".weight_")]}
        out[f"{m}.weight"] = lambda parts=parts: weight(parts)
    return out


def fuse_experts(loaders: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Per-expert checkpoint tensors (given as loaders) fused into transformers' 3-D expert parameters, by transformers' own mapping.

    The same WeightConverters `from_pretrained` applies (transformers.conversion_mapping), collected in
    its order (natural sort, so expert 10 follows 9) and converted one target at a time.
    """
    from copy import deepcopy

    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    mapping = get_checkpoint_conversion_mapping(model_type) or []
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    out, pending = {}, {}
    for key in sorted(loaders, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            out[target] = loaders[key]()
            continue
        conv = pending.setdefault(target, deepcopy(by_pattern[pattern]))
        conv.add_tensor(target, key, pattern, loaders[key])  # read when converted (transformers' sync path)
    for target, conv in pending.items():
        out.update(conv.convert(target))
    return out
