"""transformers capture backend: the demo backend and the reference every other backend is tested against.

Capture points (DESIGN.md §2), with N = num_hidden_layers:
  id k < N: a forward *pre*-hook on decoder layer k takes its input hidden states;
  id N:     a forward hook on decoder layer N-1 takes its output, before the final norm.
"""

from __future__ import annotations

from typing import Any

from .base import CaptureBackend, CaptureSpec


def decoder_layers(model: Any) -> Any:
    """The ModuleList of decoder layers of a transformers causal LM (Llama, Qwen, DeepSeek, ...)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(base, "layers"):
        raise ValueError(f"{type(model).__name__}: no decoder `layers` found; this architecture is not supported")
    return base, base.layers


def _first_tensor(x: Any) -> Any:
    return x[0] if isinstance(x, tuple) else x


class HFBackend(CaptureBackend):
    name = "hf"

    def __init__(self, spec: CaptureSpec, options: dict[str, Any]):
        super().__init__(spec, options)
        self.model = None
        self._captured: dict[int, Any] = {}
        self._handles: list[Any] = []

    def probe(self) -> dict[str, Any]:
        import torch
        import transformers

        dtype = getattr(torch, self.spec.dtype)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            self.spec.model_path, dtype=dtype, trust_remote_code=self.spec.trust_remote_code
        ).to(self.spec.device)
        self.model.eval()
        self.base, layers = decoder_layers(self.model)
        n = len(layers)
        for lid in self.spec.layer_ids:
            if lid < n:
                self._handles.append(layers[lid].register_forward_pre_hook(self._pre_hook(lid), with_kwargs=True))
            elif lid == n:
                self._handles.append(layers[n - 1].register_forward_hook(self._post_hook(lid)))
            else:
                raise ValueError(f"layer id {lid} > N = {n}: the model has no such layer")
        hidden = self.model.config.get_text_config().hidden_size
        # Smoke capture: one short row must come back with every layer, shaped [T, H].
        out = self.capture([[1, 2, 3]])
        if sorted(out) != sorted(self.spec.layer_ids) or any(tuple(t.shape) != (3, hidden) for t in out.values()):
            raise RuntimeError(f"hf smoke capture returned {[(k, tuple(v.shape)) for k, v in out.items()]}")
        return {
            "engine": "transformers",
            "engine_version": transformers.__version__,
            "torch_version": torch.__version__,
            "capture_path": "hf_hooks",
            "device": self.spec.device,
            "tp_size": 1,
            "final_layer_reachable": True,
            "num_hidden_layers": n,
            "hidden_size": hidden,
            "dtype": self.spec.dtype,
        }

    def _pre_hook(self, lid: int):
        def hook(module, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            self._captured[lid] = hs.detach()  # [B, T, H]

        return hook

    def _post_hook(self, lid: int):
        def hook(module, args, output):
            self._captured[lid] = _first_tensor(output).detach()  # [B, T, H]

        return hook

    def capture(self, batch: list[list[int]]) -> dict[int, Any]:
        import torch

        lengths = [len(r) for r in batch]
        t_max = max(lengths)
        ids = torch.zeros(len(batch), t_max, dtype=torch.long)  # right padding: causal attention
        mask = torch.zeros(len(batch), t_max, dtype=torch.long)  # never lets a row see its pads
        for i, row in enumerate(batch):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        self._captured = {}
        with torch.inference_mode():
            # The base model only: the LM head's [B, T, vocab] logits are not needed.
            self.base(input_ids=ids.to(self.spec.device), attention_mask=mask.to(self.spec.device), use_cache=False)
        out = {}
        for lid in self.spec.layer_ids:
            hs = self._captured[lid]  # [B, T_max, H]
            out[lid] = torch.cat([hs[i, :n] for i, n in enumerate(lengths)]).to("cpu")  # [sum_T, H]
        self._captured = {}
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.model = None
