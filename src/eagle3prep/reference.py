"""An independent transformers forward: the reference every capture is compared against.

Deliberately not the hf backend's code path: ids k < N come from `output_hidden_states[k]`, and id N
from a pre-hook on the final norm (its input is the pre-norm final state), one row at a time, fp32.
"""

from __future__ import annotations

from typing import Any


class Reference:
    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        ).to(device)
        self.model.eval()
        self.device = device
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        self.n = len(base.layers)
        self._final = None
        base.norm.register_forward_pre_hook(self._norm_hook)

    def _norm_hook(self, module, args):
        self._final = args[0].detach()

    def hidden_states(self, input_ids: list[int], layer_ids: list[int]) -> dict[int, Any]:
        """{layer_id: [T, H] float32 CPU tensor} for one row."""
        torch = self.torch
        with torch.inference_mode():
            out = self.model(torch.tensor([input_ids], device=self.device), output_hidden_states=True, use_cache=False)
        result = {}
        for lid in layer_ids:
            hs = self._final if lid == self.n else out.hidden_states[lid]  # [1, T, H]
            result[lid] = hs[0].float().cpu()
        return result


def compare(captured, reference) -> dict[str, float]:
    """Error of `captured` against `reference` ([T, H] each): max abs, relative (Frobenius), min cosine.

    Both magnitude and direction: a wrongly scaled stream keeps a cosine near 1 (DESIGN.md §6).
    """
    import torch

    c, r = captured.float(), reference.float()
    diff = c - r
    cos = torch.nn.functional.cosine_similarity(c, r, dim=-1)  # [T]
    return {
        "max_abs": float(diff.abs().max()),
        "rel": float(diff.norm() / r.norm().clamp_min(1e-30)),
        "min_cos": float(cos.min()),
    }


# Pass rule per stored dtype, against an fp32 reference.
# fp32: fixed bounds (two fp32 forwards differ only by summation order).
# bf16/fp16: the same rows are also run through transformers in that dtype; the gap between that
# run and fp32 is the dtype's rounding noise on *this* model and row (`floor`). A capture passes when
# its error is within FLOOR_FACTOR x that noise (or a small absolute bound, whichever is larger). A
# layer off by one, a post-norm final state or a 1/2.5 scale sit orders of magnitude above it.
FLOOR_FACTOR = 3.0
TOLERANCES = {
    "float32": {"max_abs": 1e-4, "rel": 1e-5, "min_cos": 0.99999},
    "float16": {"rel": 2e-3, "min_cos": 0.9999},
    "bfloat16": {"rel": 1e-2, "min_cos": 0.999},
}


def bounds(dtype: str, floor: dict[str, float] | None = None) -> dict[str, float]:
    """The pass bounds for a capture stored in `dtype`; `floor` = compare(ref_in_dtype, ref_fp32)."""
    tol = dict(TOLERANCES[dtype])
    if dtype != "float32" and floor is not None:
        tol["rel"] = max(tol["rel"], FLOOR_FACTOR * floor["rel"])
        tol["min_cos"] = min(tol["min_cos"], 1 - FLOOR_FACTOR * (1 - floor["min_cos"]))
    return tol


def within(err: dict[str, float], tol: dict[str, float]) -> bool:
    ok = err["rel"] <= tol["rel"] and err["min_cos"] >= tol["min_cos"]
    if "max_abs" in tol:
        ok = ok and err["max_abs"] <= tol["max_abs"]
    return ok
