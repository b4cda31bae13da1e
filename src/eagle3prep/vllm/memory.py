"""GPU memory that vLLM's budget does not see, planned before the engine starts (DESIGN.md §5).

vLLM sizes its KV cache from a profile run that computes no prompt logprobs and runs no capture hook, then
takes `gpu_memory_utilization` of the card. What the logits check and the hooks allocate on top must fit in
the rest. On a 141 GB card at 0.85, prompt logprobs of one 16,384-token chunk over a 128,256-token vocabulary did
not: vLLM's `compute_logprobs` asked for 7.83 GiB (one fp32 [tokens, vocab] tensor) and the engine died.

So the logits check asks vLLM for at most LOGPROB_WINDOW tokens of a row at once (capture/requests.py sends a prefix
request for a longer row), and the utilisation is lowered where the rest of the card cannot hold the peak.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from ..errors import UserError

# Tokens of a row whose prompt logprobs vLLM computes in one piece: [2048, 163,840] (Kimi-K2.5's vocabulary)
# peaks at 3.4 GiB, which the rest of a 0.85-utilised 80 GB card holds; a longer row's check covers its first
# LOGPROB_WINDOW tokens (the captured state at a position depends only on the tokens before it).
LOGPROB_WINDOW = 2048
# Bytes per [token, vocab] element at the peak of vLLM's prompt logprobs: the logits in the model dtype, their
# fp32 copy and log_softmax's fp32 output (Sampler.compute_logprobs), and the rank count's bool mask.
LOGPROB_BYTES_PER_ELEMENT = 2 + 4 + 4 + 1
# The allocator's fragmentation and the CUDA context's growth after vLLM measured it.
HEADROOM_BYTES = 1 << 30
MIN_UTILIZATION = 0.30  # below this the KV cache is too small to be worth starting: refuse instead
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What the engine is started with, and why."""

    gpu_memory_utilization: float
    need_bytes: int  # outside vLLM's budget: the logits check's peak plus the hooks' step copies
    total_bytes: int | None  # the card's memory (None: unknown, e.g. on the CPU)
    note: str  # one line for the job's log and the shard's manifest


def logprob_peak_bytes(vocab_size: int, window: int = LOGPROB_WINDOW) -> int:
    """Peak GPU bytes of vLLM's prompt logprobs for `window` tokens of one request."""
    return window * vocab_size * LOGPROB_BYTES_PER_ELEMENT


def hooks_peak_bytes(step_tokens: int, hidden_size: int, num_layers: int, dtype_bytes: int = 2) -> int:
    """The hooks path's copies of one step's residual stream (hidden + residual, one per captured layer, kept
    until the side stream has copied them to host), which vLLM's profile run never saw."""
    return step_tokens * hidden_size * dtype_bytes * num_layers


def plan(utilization: float, total_bytes: int | None, need_bytes: int, *, section: str = "extract") -> MemoryPlan:
    """Keep `need_bytes` + HEADROOM_BYTES outside vLLM's budget: lower the utilisation where the card's rest is
    smaller. A card too small for that stops here, before the engine starts, in one line with the numbers."""
    if not total_bytes or need_bytes <= 0:
        return MemoryPlan(utilization, need_bytes, total_bytes, f"{section}.gpu_memory_utilization {utilization}")
    outside = (1.0 - utilization) * total_bytes
    want = need_bytes + HEADROOM_BYTES
    numbers = (
        f"{need_bytes / GiB:.2f} GiB + {HEADROOM_BYTES / GiB:.0f} GiB headroom of a {total_bytes / GiB:.1f} GiB GPU"
    )
    if outside >= want:
        note = f"{section}.gpu_memory_utilization {utilization}: leaves {outside / GiB:.1f} GiB for {numbers}"
        return MemoryPlan(utilization, need_bytes, total_bytes, note)
    lowered = int((1.0 - want / total_bytes) * 100) / 100  # floor to 0.01: never above what fits
    if lowered < MIN_UTILIZATION:
        raise UserError(
            f"the logits check and capture need {numbers} outside vLLM's budget, leaving it "
            f"{max(lowered, 0):.2f} of the card: set {section}.logprob_rows: 0 or lower {section}.max_num_batched_tokens"
        )
    note = f"{section}.gpu_memory_utilization {utilization} -> {lowered}: keeps {numbers} outside vLLM's budget"
    return MemoryPlan(lowered, need_bytes, total_bytes, note)


def gpu_total_bytes(index: int = 0) -> int | None:
    """Memory of the job's first visible GPU from nvidia-smi, without initialising CUDA in this process (vLLM
    forks its workers only when it has not been); None without nvidia-smi or a GPU."""
    import os

    if shutil.which("nvidia-smi") is None:
        return None
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    target = visible[index] if len(visible) > index else str(index)
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={target}", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return int(float(out.strip().splitlines()[0])) * (1 << 20)  # MiB
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None
