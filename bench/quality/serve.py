"""The target in vLLM, alone or with a speculators draft, on held-out prompts: acceptance and tokens/s.

Runs under a Python with vLLM, one engine per process:
    python bench/quality/serve.py MODEL PROMPTS.json RESULT.json [--draft DIR] [--type eagle3] [--k 3]
                                  [--max-tokens 256]

eagle3 is served as method eagle3 with k draft tokens; another type (peagle, dflash, dspark, ...) through
vLLM's speculators loader (the draft folder as the model: its config names the target and the method, peagle
as eagle3 with parallel drafting) with its checkpoint's own number of draft tokens.

Greedy. The acceptance figures are vLLM's own spec-decode counters: drafts (verification steps that
carried draft tokens), draft tokens, accepted tokens, and accepted tokens per draft position.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def counters(llm) -> dict:
    """vLLM's spec_decode metrics as plain numbers (a Vector's values as a list)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name.removeprefix("vllm:spec_decode_")] = m.values if hasattr(m, "values") else m.value
    return out


def acceptance(spec: dict, k: int) -> dict:
    """Mean acceptance length 1 + accepted / drafts, and the share of drafts accepted at each position."""
    drafts, accepted = spec.get("num_drafts", 0), spec.get("num_accepted_tokens", 0)
    per_pos = spec.get("num_accepted_tokens_per_pos") or [0] * k
    return {
        "drafts": drafts,
        "draft_tokens": spec.get("num_draft_tokens", 0),
        "accepted": accepted,
        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
        "acceptance_per_position": [round(a / drafts, 4) for a in per_pos] if drafts else None,
    }


def serve(model: str, prompts: list[list[int]], draft: str | None, k: int, max_tokens: int, kind: str) -> dict:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not in the H200 payload
    from vllm import LLM, SamplingParams

    # Engines share the GPU (device_run.sh serves drafts side by side): a fixed KV cache skips vLLM's memory
    # profiling, which fails when another process frees memory meanwhile.
    kwargs = {"model": model, "dtype": "bfloat16", "gpu_memory_utilization": 0.1, "disable_log_stats": False}
    kwargs["kv_cache_memory_bytes"] = 2 << 30
    kwargs["seed"] = 0
    if draft and kind == "eagle3":
        kwargs["speculative_config"] = {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    elif draft:  # vLLM reads the verifier's path and the method from the draft's speculators config
        kwargs["model"] = draft
    t0 = time.time()
    llm = LLM(**kwargs)
    start_s = time.time() - t0
    if draft:
        k = llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params)  # warm-up, not counted below
    before = counters(llm)
    t0 = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.time() - t0
    after = counters(llm)
    spec = {}
    for key, v in after.items():
        b = before.get(key, 0)
        spec[key] = [x - y for x, y in zip(v, b or [0] * len(v), strict=True)] if isinstance(v, list) else v - b
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "draft": draft,
        "type": kind if draft else None,
        "k": k,
        "prompts": len(prompts),
        "engine_start_s": round(start_s, 1),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 1),
        "spec_decode": spec,
        **(acceptance(spec, k) if draft else {}),
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("prompts", type=Path)
    ap.add_argument("result", type=Path)
    ap.add_argument("--draft")
    ap.add_argument("--type", default="eagle3", help="the draft's speculators type")
    ap.add_argument("--k", type=int, default=3, help="eagle3's draft tokens")
    ap.add_argument("--max-tokens", type=int, default=256)
    opts = ap.parse_args(argv)
    res = serve(opts.model, json.loads(opts.prompts.read_text()), opts.draft, opts.k, opts.max_tokens, opts.type)
    opts.result.write_text(json.dumps(res))
    print(json.dumps({k: v for k, v in res.items() if k != "outputs"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
