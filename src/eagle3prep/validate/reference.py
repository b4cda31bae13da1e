"""An independent transformers forward: the reference every capture is compared against.

Deliberately not the hf backend's code path: ids k < N come from `output_hidden_states[k]`, and id N
from a pre-hook on the final norm (its input is the pre-norm final state), one row at a time.
The exact reference runs in fp32 with TF32 off; the *floor* run repeats it at the engine's working
precision, so the pass rule (passrule.py) can judge a capture by what that precision does (DESIGN.md §6).
"""

from __future__ import annotations

import contextlib
from typing import Any

from .routing import MarginRecorder, before_layer


class Reference:
    """A transformers model that returns the hidden states of one row at the requested layer ids.

    `tf32=True` lets fp32 matmuls and convolutions on a GPU use TensorFloat-32, as GPU engines'
    fp32 kernels do; it changes nothing on a CPU.
    """

    def __init__(
        self,
        model_path: str,
        device: str,
        dtype: str = "float32",
        *,
        trust_remote_code: bool,
        tf32: bool = False,
    ):
        import torch

        from ..tokenize.row_inputs import load_target

        self.torch = torch
        self.model = load_target(model_path, getattr(torch, dtype), trust_remote_code).to(device)
        self.model.eval()
        self.device = device
        self.tf32 = tf32
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        self.n = len(base.layers)
        self._final = None
        base.norm.register_forward_pre_hook(self._norm_hook)
        self.router_margins = MarginRecorder(self.model)

    def _norm_hook(self, module, args):
        self._final = args[0].detach()

    @contextlib.contextmanager
    def _precision(self):
        """TF32 on or off for this forward only (the flag is process-wide)."""
        torch = self.torch
        old = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
        torch.set_float32_matmul_precision("high" if self.tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = self.tf32
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(old[0])
            torch.backends.cudnn.allow_tf32 = old[1]

    def hidden_states(self, input_ids: list[int], layer_ids: list[int], images: dict | None = None) -> dict[int, Any]:
        """{layer_id: [T, H] float32 CPU tensor} for one row; its router margins in `self.margins`. `images`: a
        row with images' pixel inputs (tokenize.row_inputs.RowImages.batch)."""
        torch = self.torch
        extra = {k: v.to(self.device) for k, v in (images or {}).items()}
        with torch.inference_mode(), self._precision():
            ids = torch.tensor([input_ids], device=self.device)
            out = self.model(ids, output_hidden_states=True, use_cache=False, **extra)
        self.margins = self.router_margins.take()  # {MoE layer index: [T]}, {} for a dense model
        result = {}
        for lid in layer_ids:
            hs = self._final if lid == self.n else out.hidden_states[lid]  # [1, T, H]
            result[lid] = hs[0].float().cpu()
        return result


def floor_precision(dtype: str, device: str) -> dict[str, Any] | None:
    """How the floor run computes for a capture stored in `dtype`; None when it would equal the reference.

    bf16/fp16: the model in that dtype. fp32: TF32 matmuls on a GPU (fp32 engines use TF32-class
    kernels there); on a CPU fp32 has no cheaper mode, so the reference is its own floor.
    """
    if dtype != "float32":
        return {"dtype": dtype, "tf32": False}
    if device.startswith("cuda"):
        return {"dtype": "float32", "tf32": True}
    return None


class ReferencePair:
    """The exact fp32 reference and the floor run of one model, with per-row results cached.

    The cache lets one validation job judge many layers, and the validation matrix judge many
    planted shards of the same rows, for one forward per row and precision.
    """

    def __init__(
        self,
        model_path: str,
        dtype: str,
        device: str,
        trust_remote_code: bool,
        cache_rows: int = 1,
    ):
        self.exact = Reference(model_path, device=device, trust_remote_code=trust_remote_code)
        how = floor_precision(dtype, device)
        self.floor_how = how
        self.floor = Reference(model_path, device=device, trust_remote_code=trust_remote_code, **how) if how else None
        self.n = self.exact.n
        self.cache_rows = cache_rows
        self._cache: dict[tuple, tuple[dict[int, Any], dict[int, Any] | None, dict[int, Any]]] = {}

    def describe(self) -> str:
        """The floor run in words, for messages ('bfloat16 transformers on cuda')."""
        if self.floor_how is None:
            return "none (fp32 on a CPU: the reference is exact)"
        how = self.floor_how["dtype"] + (" with TF32" if self.floor_how["tf32"] else "")
        return f"transformers {how} on {self.exact.device}"

    def rows(
        self, input_ids: list[int], layer_ids: list[int], images: dict | None = None
    ) -> tuple[dict[int, Any], dict[int, Any] | None]:
        """(reference, floor) hidden states of one row (with its `images`, as Reference.hidden_states); floor
        is None when the reference is exact."""
        key = _key(input_ids, images)
        if key not in self._cache:
            # A cache of many rows serves other layer ids too (the matrix's planted shards): keep every id.
            want = sorted(set(layer_ids) | set(range(self.n + 1))) if self.cache_rows > 1 else list(layer_ids)
            ref = self.exact.hidden_states(list(input_ids), want, images)
            margins = self.exact.margins
            floor = self.floor.hidden_states(list(input_ids), want, images) if self.floor else None
            if len(self._cache) >= self.cache_rows:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = (ref, floor, margins)
        return self._cache[key][:2]

    def margins(self, input_ids: list[int], layer_id: int, images: dict | None = None):
        """[T] smallest router margin (exact reference) over the MoE layers feeding `layer_id`; None if dense."""
        self.rows(input_ids, [layer_id], images)
        return before_layer(self._cache[_key(input_ids, images)][2], layer_id)


def _key(input_ids: list[int], images: dict | None) -> tuple:
    """A row's cache key: its tokens and, for a row with images, its pixels (two rows' images may be swapped)."""
    if not images:
        return tuple(input_ids)
    import hashlib

    pixels = hashlib.sha256(images["pixel_values"].float().numpy().tobytes()).hexdigest()
    return (*input_ids, pixels, *images["image_grid_thw"].flatten().tolist())
