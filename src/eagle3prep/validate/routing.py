"""Router margins of a transformers MoE: how close each token's expert choice came to a tie (DESIGN.md §6).

A forward hook on every MoE layer's router (`layer.mlp.gate`, whose public output is
(router_logits, weights, indices)) recomputes, from the logits, the quantity the router ranks:
- Qwen-MoE (Qwen2-MoE, Qwen3-MoE): softmax probabilities, top-k;
- DeepSeek-V3 (sigmoid, noaux_tc): sigmoid scores plus e_score_correction_bias, top groups by the sum of
  each group's two best, then top-k within them.
Per token, the margin is the gap between the last chosen and the first unchosen, relative to the chosen
one (the smaller of the group and expert stages for DeepSeek). Two engines whose router inputs differ by
rounding can choose differently only where it is small. The recomputed choice is checked against the
router's own indices on every call, so a change of transformers' routing fails loudly instead of
producing wrong margins.
"""

from __future__ import annotations

import contextlib
from typing import Any


class RoutingChanged(RuntimeError):
    """transformers' router no longer routes as this module recomputes it."""


# transformers model types whose routers this module recomputes (and checks); other MoEs (remote code too)
# get no margins, so the pass rule judges them as before (no near-tie clause).
KNOWN = ("deepseek_v3", "qwen2_moe", "qwen3_moe")


def routers(model) -> dict[int, Any]:
    """{decoder layer index: router module} of a KNOWN transformers MoE ({} for a dense or other model).

    Raises RoutingChanged when a KNOWN MoE's router is not where this module looks.
    """
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "model_type", "") not in KNOWN:
        return {}
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    found = {
        i: layer.mlp.gate
        for i, layer in enumerate(base.layers)
        if hasattr(getattr(layer, "mlp", None), "gate") and hasattr(layer.mlp.gate, "top_k")
    }
    moe = any(getattr(cfg, k, 0) for k in ("num_experts", "n_routed_experts", "num_local_experts"))
    if moe and not found:
        raise RoutingChanged(
            f"{type(model).__name__}: an MoE config but no layer.mlp.gate with top_k: transformers moved its router "
            "(update eagle3prep/validate/routing.py)"
        )
    return found


def ranked(gate, logits):
    """The quantity the router ranks, [T, E] float32, and for a grouped router the group mask [T, E]."""
    import torch

    logits = logits.float()
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is None:  # Qwen-MoE: top-k of the softmax
        return torch.softmax(logits, dim=-1), None
    scores = logits.sigmoid() + bias.float()  # DeepSeek-V3: sigmoid plus correction bias
    n_group, topk_group = gate.num_group, gate.topk_group
    groups = scores.view(len(scores), n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    chosen = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(topk_group, dim=-1)[1], True)
    return scores, (chosen, groups)


def _gap(values, k: int):
    """(v_k - v_{k+1}) / |v_k| of each row's sorted values; inf when there is no (k+1)-th."""
    import torch

    if values.shape[-1] <= k:  # e.g. one expert group (Kimi-K2.5's n_group 1); on values' device, for torch.minimum
        return torch.full(values.shape[:-1], float("inf"), device=values.device)
    top = values.topk(k + 1, dim=-1)[0]
    last, nxt = top[..., k - 1], top[..., k]
    gap = (last - nxt) / last.abs().clamp_min(1e-30)
    return torch.where(torch.isinf(nxt), torch.full_like(gap, float("inf")), gap)


def margins(gate, logits, indices=None):
    """[T] relative top-k margin per token; checks the recomputed choice against `indices` when given."""
    import torch

    scores, grouped = ranked(gate, logits)
    k = gate.top_k
    if grouped is None:
        choice, margin = scores, _gap(scores, k)
    else:
        chosen, groups = grouped
        per_group = scores.shape[-1] // groups.shape[-1]
        choice = scores.masked_fill(~chosen.repeat_interleave(per_group, dim=-1), float("-inf"))
        margin = torch.minimum(_gap(choice, k), _gap(groups, gate.topk_group))
    if indices is not None:
        mine, theirs = choice.topk(k, dim=-1)[1].sort(-1)[0], indices.reshape(len(choice), -1).sort(-1)[0]
        if bool(((mine != theirs).any(-1) & (margin > 0)).any()):
            raise RoutingChanged(
                f"{type(gate).__name__}: its chosen experts differ from routing.py's recomputation: transformers "
                "changed how it routes (update eagle3prep/validate/routing.py)"
            )
    return margin.cpu()


class MarginRecorder:
    """Forward hooks on every router of `model`; `take()` returns {layer index: [T] margins} of the last forward."""

    def __init__(self, model):
        self._seen: dict[int, Any] = {}
        self.layers = routers(model)
        for i, gate in self.layers.items():
            gate.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(gate, args, out):
            if not (isinstance(out, tuple) and len(out) == 3):
                raise RoutingChanged(
                    f"{type(gate).__name__} returned {type(out).__name__}, not (router_logits, weights, indices): "
                    "transformers changed its router (update eagle3prep/validate/routing.py)"
                )
            self._seen[i] = margins(gate, out[0].detach(), out[2].detach())

        return hook

    def take(self) -> dict[int, Any]:
        seen, self._seen = self._seen, {}
        return seen


def before_layer(per_layer: dict[int, Any], layer_id: int):
    """[T] smallest margin over the MoE layers that feed hidden-state id `layer_id` (layers < id); None if none."""
    import torch

    feeding = [m for i, m in per_layer.items() if i < layer_id]
    return torch.stack(feeding).min(dim=0)[0] if feeding else None


def _weights(gate, logits, indices):
    """The router's expert weights for `indices`, as transformers computes them for the chosen experts."""
    logits = logits.float()
    grouped = getattr(gate, "e_score_correction_bias", None) is not None
    probs = logits.sigmoid() if grouped else logits.softmax(dim=-1)
    w = probs.gather(1, indices)
    if getattr(gate, "norm_topk_prob", False):
        w = w / (w.sum(dim=-1, keepdim=True) + (1e-20 if grouped else 0.0))
    return w * getattr(gate, "routed_scaling_factor", 1.0) if grouped else w


@contextlib.contextmanager
def force_reroute(model, layer: int, token: int):
    """Within the block, MoE layer `layer` sends `token` to its runner-up expert instead of its k-th choice.

    What another engine does at a near-tie (and a planted mistake elsewhere: planted.rerouted).
    """
    import torch

    gate = routers(model)[layer]

    def hook(gate, args, out):
        logits, _, indices = out
        scores, grouped = ranked(gate, logits)
        if grouped is not None:
            per_group = scores.shape[-1] // grouped[1].shape[-1]
            scores = scores.masked_fill(~grouped[0].repeat_interleave(per_group, dim=-1), float("-inf"))
        order = scores[token].topk(gate.top_k + 1)[1]  # best first: [k-th choice at -2, runner-up at -1]
        indices = indices.clone()
        row = indices[token]
        row[row == order[-2]] = order[-1]
        weights = _weights(gate, logits, indices).to(out[1].dtype)
        return logits, weights, indices

    handle = gate.register_forward_hook(hook)
    try:
        with torch.no_grad():
            yield
    finally:
        handle.remove()
