"""A fake generation engine for the regenerate stage's tests, and a job entry point that runs one shard through it
(tests/test_regenerate.py kills that process mid-shard).

    python tests/testkit/regenerate.py MODEL PROMPTS_SHARD OUT_DIR SHARD
"""

from __future__ import annotations

import sys

from eagle3prep.regenerate import Finished, PromptRenderer, RegenerateSettings, RequestRejected, regenerate_shard

U1, U2 = {"role": "user", "content": "How do I fix a bike chain?"}, {"role": "user", "content": "And the brakes?"}
A1, A2 = {"role": "assistant", "content": "Dataset answer one."}, {"role": "assistant", "content": "Dataset two."}
SYS = {"role": "system", "content": "Be brief."}


class FakeEngine:
    """Replies with the canonical ids of script(prompt text) (+ the stop token when it says "stop"); finishes the
    requests of each step in the reverse order they were added, at most `per_step` a step."""

    def __init__(self, renderer: PromptRenderer, script, per_step: int = 3, refuse=(), expand=None):
        self.renderer, self.script, self.per_step, self.refuse = renderer, script, per_step, set(refuse)
        self.expand = expand  # (prompt ids, images) -> the ids the model ran, as vLLM's processor reports them
        self.ran: dict[str, list[int]] = {}
        self.queue: list[tuple[str, list[int], int]] = []
        self.prompts: dict[str, str] = {}  # request id -> prompt text
        self.seeds: dict[str, int] = {}
        self.ids: dict[str, list[int]] = {}  # request id -> prompt ids, as given
        self.images: dict[str, list] = {}  # request id -> images given with the prompt (prompts with images only)
        self.most_in_flight = 0

    def add(self, request_id, prompt_ids, seed, images=None):
        text = self.renderer.tokenizer.decode(prompt_ids)
        if any(r in text for r in self.refuse):
            raise RequestRejected("prompt refused by the fake engine")
        self.queue.append((request_id, prompt_ids, seed))
        self.prompts[request_id], self.seeds[request_id], self.ids[request_id] = text, seed, list(prompt_ids)
        if images is not None:
            self.images[request_id] = images
            if self.expand is not None:
                self.ran[request_id] = self.expand(list(prompt_ids), images)
        self.most_in_flight = max(self.most_in_flight, len(self.queue))

    def step(self):
        done, self.queue = self.queue[-self.per_step :][::-1], self.queue[: -self.per_step]
        out = []
        for rid, _, _ in done:
            reply, reason = self.script(self.prompts[rid])
            ids = self.renderer.encode(reply)
            if reason == "stop":
                ids.append(self.renderer.tokenizer.eos_token_id)
            out.append(Finished(rid, ids, reason, "boom" if reason == "error" else "", self.ran.get(rid)))
        return out

    def has_unfinished(self):
        return bool(self.queue)

    def abort(self, request_ids):
        self.queue = [q for q in self.queue if q[0] not in set(request_ids)]


def echo(prompt_text: str) -> tuple[str, str]:
    """A reply naming the last user message, stopped normally."""
    last = prompt_text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
    return f"Target on: {last}", "stop"


def conv(messages, cid="c", source="s.jsonl:1", **extra) -> dict:
    return {"id": cid, "messages": messages, "source": source, **extra}


def run_shard(model: str, prompts: str, out_dir: str, shard: int, per_step: int = 3) -> dict:
    """regenerate_shard with the fake engine (greedy defaults), as the regenerate job runs it with vLLM."""
    renderer = PromptRenderer.load(model, trust_remote_code=False, chat_template_kwargs={})
    return regenerate_shard(
        prompts, out_dir, FakeEngine(renderer, echo, per_step), renderer, RegenerateSettings.defaults(), max_model_len=1024,
        engine_info={"engine": "fake"}, model_path=model, trust_remote_code=False, shard=shard, code="test",
    )  # fmt: skip


if __name__ == "__main__":
    run_shard(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), per_step=1)
