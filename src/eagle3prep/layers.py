"""Layer numbering (DESIGN.md §2) — the most common silent bug in this field, so it lives in one place.

Our convention ("input_of_layer", the one vLLM uses for `eagle_aux_hidden_state_layer_ids`):
  - id k, 0 <= k < N: the input of decoder layer k = the residual stream after k layers
    (transformers' output_hidden_states[k]; k = 0 is the embedding output);
  - id N: the output of the last decoder layer *before* the final norm.
Other conventions are converted exactly once, when the config is loaded.
"""

from __future__ import annotations

CONVENTION = "input_of_layer"

# name -> offset added to a configured id to get our id. Every source's numbering is one of two:
#   input_of_layer: ours; vLLM's eagle_aux_hidden_state_layer_ids; speculators >= 0.5 --target-layer-ids
#     (models/utils.resolve_target_layer_ids accepts 0..N, N = the final state launch_vllm.py appends);
#     transformers' output_hidden_states[k] for k < N.
#   output_of_layer: older speculators (<= 0.4) and SGLang's explicit ids, and published DFlash checkpoints'
#     dflash_config.target_layer_ids (speculators' DFlash converter adds 1: "z-lab reads hidden_states[layer_id + 1]")
#     name the *output* of decoder layer k, which is the input of layer k + 1. Their "last layer" N-1 is our N.
# `vllm` and `speculators` are input_of_layer under the name of the source a user copies ids from.
CONVENTIONS = {"input_of_layer": 0, "output_of_layer": 1, "vllm": 0, "speculators": 0}


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """[2, N//2, N-3, N]: three auxiliary layers plus the pre-norm final state (sorted, unique)."""
    n = num_hidden_layers
    return sorted({min(2, n), n // 2, max(n - 3, 0), n})


def convert_layer_ids(ids: list[int], convention: str) -> list[int]:
    """Convert configured ids from `convention` to ours. Range checks need N: see check_layer_ids."""
    if convention not in CONVENTIONS:
        raise ValueError(
            f"layers.convention = {convention!r} is not one of {sorted(CONVENTIONS)}; "
            "use input_of_layer (= vllm, speculators) for vLLM-style ids, output_of_layer for published DFlash, "
            "older speculators and SGLang ids"
        )
    return [int(i) + CONVENTIONS[convention] for i in ids]


def check_layer_ids(
    ids: list[int], num_hidden_layers: int, where: str = "layers.ids", convention: str = CONVENTION
) -> list[int]:
    """Validate ids (our convention) against the model depth N; return them unchanged. Messages show the ids
    in `convention`, the one the user wrote them in: ids they never typed would not point at the mistake."""
    n = num_hidden_layers
    off = CONVENTIONS[convention]
    shown = to_convention(list(ids), convention)
    lo, hi = -off, n - off  # our 0..N in the user's convention
    named = "" if convention == CONVENTION else f" ({convention})"
    if not ids:
        raise ValueError(f"{where} is empty; give at least one layer id in {lo}..{hi}{named}")
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in shown if shown.count(i) > 1})
        raise ValueError(f"{where} has duplicate layer ids {dup}; each id may appear once")
    bad = [s for s, i in zip(shown, ids, strict=True) if not 0 <= i <= n]
    if bad:
        final = "the output of the last decoder layer, before the final norm" if off else "the pre-norm final state"
        raise ValueError(
            f"{where} = {shown}{named} has ids {bad} outside {lo}..{hi} (the model has N = {n} decoder layers; "
            f"id {hi} is {final})"
        )
    if list(ids) != sorted(ids):
        raise ValueError(f"{where} = {shown} must be in ascending order (layer files and exports follow it)")
    return list(ids)


def resolve_layer_ids(configured: list[int] | None, convention: str, num_hidden_layers: int) -> list[int]:
    """The layer ids to capture, in our convention, validated against the model."""
    if configured is None:
        return default_layer_ids(num_hidden_layers)
    return check_layer_ids(convert_layer_ids(configured, convention), num_hidden_layers, convention=convention)


def to_convention(ids: list[int], convention: str) -> list[int]:
    """Our ids expressed in another convention (for hand-offs, e.g. a trainer's --target-layer-ids)."""
    return [i - CONVENTIONS[convention] for i in ids]


# ---- where an id is taken from a running model (both capture backends use this) -------------------


def decoder_stack(model: object) -> object:
    """The module that owns `.layers`: model.model of a causal LM, or of a VLM's language model."""
    if hasattr(model, "get_language_model"):
        model = model.get_language_model()
    # transformers' image-text wrappers (Qwen2.5-VL) have no get_language_model: model.model.language_model
    wrapped = getattr(getattr(model, "model", None), "language_model", None)
    for candidate in (getattr(model, "model", None), wrapped, model):
        if candidate is not None and hasattr(candidate, "layers"):
            return candidate
    raise ValueError(f"{type(model).__name__}: no decoder `layers` found; this architecture is not supported")


def hook_point(layer_id: int, num_hidden_layers: int) -> tuple[int, str]:
    """(decoder layer, "input" | "output") whose hook sees id `layer_id`: the embedding output is the
    input of layer 0; every later id k is the output of layer k-1 (id N: the last layer, pre-norm)."""
    check_layer_ids([layer_id], num_hidden_layers, where="layer id")
    return (0, "input") if layer_id == 0 else (layer_id - 1, "output")
