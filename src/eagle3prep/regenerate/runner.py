"""The regenerate loop, independent of vLLM: conversations in, regenerated conversations or quarantine records
out, in input order, through any engine with the `Engine` interface (engine.VLLMEngine; a fake in the tests).

Requests stream into the engine: a conversation's next turn is added as soon as its previous reply finishes,
so the engine's batch stays full across turns (continuous batching), and at most regenerate.max_in_flight
conversations are admitted and not yet written, which bounds host memory whatever the shard's size. Results
leave in input order, so a rerun writes the same bytes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from eagle3prep.infra import faults
from eagle3prep.prepare.normalize import conversation_id
from eagle3prep.records import Conversation, Quarantined
from eagle3prep.regenerate.counts import ShardTally
from eagle3prep.regenerate.prompts import PromptRenderer
from eagle3prep.regenerate.thinking import ThinkingPlan, is_empty, prompt_prefill, reply_message
from eagle3prep.regenerate.turns import Rejection, TurnPlan, assemble, context_before, plan_turns
from eagle3prep.settings import RegenerateSettings, conversation_seed
from eagle3prep.tokenize.template import Rejected, has_images
from eagle3prep.tokenize.vision import media_in_text
from eagle3prep.vllm.engine.errors import EngineError

# Conversations admitted (prompts rendered and added) per turn of the loop. Admitting a whole window before the
# first step would leave the engine idle while thousands of prompts render; in chunks, the engine (its own
# process) works on the first ones while the next render.
ADMIT_PER_STEP = 256


class RequestRejected(Exception):
    """The engine refused one request when it was added; the message says why."""


EXPANSION_DIFFERS = "image_expansion_differs"  # quarantine reason: vLLM expanded a prompt's images otherwise


@dataclass(slots=True)
class Finished:
    """One request the engine finished: its generated ids (a stop token included) and why it ended."""

    request_id: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort | error
    detail: str = ""
    # The prompt ids the model ran, for a prompt given with images (vLLM's processor expanded them); else None.
    prompt_token_ids: list[int] | None = None


class Engine(Protocol):
    # RequestRejected on refusal. `images` (RGB PIL images) only for a prompt with images: its ids then carry one
    # placeholder an image, which the engine expands itself.
    def add(self, request_id: str, prompt_ids: list[int], seed: int, images: list | None = None) -> None: ...

    def step(self) -> list[Finished]: ...

    def has_unfinished(self) -> bool: ...

    def abort(self, request_ids: list[str]) -> None: ...


@dataclass(slots=True)
class _Reply:
    """A finished reply as text: its ids without the stop token, their text, and whether they re-encode alike."""

    ids: list[int]
    text: str
    same_ids: bool


@dataclass(slots=True)
class _Conv:
    """One conversation in flight: its plan, the replies so far, and its result once done."""

    index: int
    line: int
    record: dict[str, Any]
    plan: TurnPlan | None = None
    seed: int = 0
    replies: list[dict[str, Any]] = field(default_factory=list)
    meta: list[dict[str, Any]] = field(default_factory=list)
    prefill: str = ""
    prompt_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    result: Conversation | Quarantined | None = None


class Runner:
    """Regenerates one shard's conversations through `engine`; `run` yields the results in input order.

    Args:
        engine: the generation engine (started).
        renderer: the target's tokenizer and chat template.
        settings: regenerate.* (content: turns, sampling, policies; speed: max_in_flight).
        thinking: the resolved thinking plan.
        stop_ids: tokens that end a reply; one at the end of a stopped reply is not part of its text.
        max_model_len: prompt + reply tokens the engine takes per request.
        source: the file quarantine records name (the prepared conversations).
        tally: counts, updated as results leave.
        shard: the shard's number (kill points, request ids).
        tag: request-id prefix, unique per engine lifetime (one engine may serve several shards).
    """

    def __init__(self, engine: Engine, renderer: PromptRenderer, settings: RegenerateSettings, thinking: ThinkingPlan,
                 stop_ids: list[int], max_model_len: int, source: str, tally: ShardTally, shard: int = 0,
                 tag: str = "r"):  # fmt: skip
        self.engine, self.renderer, self.settings, self.thinking = engine, renderer, settings, thinking
        self.stop_ids, self.max_model_len, self.source, self.tally = set(stop_ids), max_model_len, source, tally
        self.shard, self.tag = shard, f"{tag}{shard}"
        self.active: dict[str, _Conv] = {}  # request id -> conversation waiting for that reply
        self.steps = 0
        self.step_s = 0.0  # time spent in engine.step(): the rest of the loop is this process's own work

    def run(self, lines: Iterable[tuple[int, dict[str, Any]]]) -> Iterator[Conversation | Quarantined]:
        """(line number in `source`, prepared conversation JSON) in, results out in the same order."""
        pending = iter(enumerate(lines))
        window: deque[_Conv] = deque()
        exhausted = False
        try:
            while True:
                room = min(self.settings.speed.max_in_flight - len(window), ADMIT_PER_STEP)
                for _ in range(0 if exhausted else max(room, 0)):
                    item = next(pending, None)
                    if item is None:
                        exhausted = True
                        break
                    index, (line, record) = item
                    conv = _Conv(index, line, record)
                    window.append(conv)
                    self._admit(conv)
                while window and window[0].result is not None:
                    yield self._leave(window.popleft())
                if not window:
                    if exhausted:
                        return
                    continue  # every admitted conversation has left: admit more
                # The head waits for a reply, so the engine holds a request of it.
                if not self.engine.has_unfinished():
                    raise RuntimeError(f"regenerate: the engine holds no request for conversation {window[0].index}")
                self._step()
        finally:
            if self.active:  # interrupted: the engine must not keep working on this shard's requests
                self.engine.abort(list(self.active))

    def _leave(self, conv: _Conv) -> Conversation | Quarantined:
        self.tally.rows_in += 1
        if isinstance(conv.result, Quarantined):
            self.tally.quarantined[conv.result.reason] += 1
        else:
            self.tally.kept += 1
        return conv.result

    def _admit(self, conv: _Conv) -> None:
        plan = plan_turns(conv.record["messages"], self.settings.content.turns)
        if isinstance(plan, Rejection):
            self._quarantine(conv, plan.reason, plan.detail)
            return
        conv.plan = plan
        if has_images(conv.record["messages"]):
            self.tally.met_images()
        conv.seed = conversation_seed(self.settings.content.sampling.seed, conv.record["id"])
        self._submit(conv)

    def _submit(self, conv: _Conv) -> None:
        """Add the request for the conversation's next reply (or quarantine it when it cannot be made)."""
        turn = len(conv.replies)
        messages = context_before(conv.plan, conv.replies)
        got = self._render(messages, conv.record.get("tools"))
        if isinstance(got, Rejected):
            self.tally.quarantined.setdefault(got.reason, 0)  # a reason of tokenize's, listed once met
            self._quarantine(conv, got.reason, f"reply {turn}: {got.detail}")
            return
        text, ids, engine_ids, images = got  # ids: with the vision tokens, as tokenize's row and the engine
        if len(ids) >= self.max_model_len:
            self._quarantine(
                conv, "prompt_too_long",
                f"reply {turn}: the prompt has {len(ids)} tokens, max_model_len is {self.max_model_len}",
            )  # fmt: skip
            return
        conv.prefill, conv.prompt_text, conv.prompt_ids = prompt_prefill(text, self.thinking.markers), text, ids
        request_id = f"{self.tag}-{conv.index}-{turn}"
        try:
            if images:
                self.engine.add(request_id, engine_ids, conv.seed, images)
            else:
                self.engine.add(request_id, ids, conv.seed)
        except RequestRejected as e:
            self.tally.replies["rejected"] += 1
            self._quarantine(conv, "engine_error", f"reply {turn}: the engine refused the request: {e}")
            return
        self.tally.replies["requests"] += 1
        self.tally.replies["prompt_tokens"] += len(ids)
        self.active[request_id] = conv

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None):
        """(prompt text, ids, the engine's ids, images or None), or Rejected: an image tokenize would refuse, or a
        chat template that raises on this conversation (tokenize quarantines it as template_error too)."""
        import jinja2

        images = has_images(messages)
        try:
            if images:
                got = self.renderer.image_prompt(messages, tools)
                if isinstance(got, Rejected):
                    return got
            else:
                text, ids = self.renderer.prompt(messages, tools)
                got = (text, ids, ids, None)
        except jinja2.TemplateError as e:
            return Rejected("template_error", f"the chat template raised: {e}")
        # A vision placeholder the text writes itself: tokenize would quarantine the row (media_token_in_text).
        return media_in_text(got[1], self.renderer.media_ids, self.renderer.image_token_id if images else None) or got

    def _step(self) -> None:
        self.steps += 1
        faults.kill_point("regenerate.step", shard=self.shard, step=self.steps)
        t0 = time.perf_counter()
        try:
            finished = self.engine.step()
        except EngineError as e:  # the engine died mid-run (VLLMEngine.step): the one line names the shard too
            raise EngineError(f"regenerate shard {self.shard}: {e}") from e
        self.step_s += time.perf_counter() - t0
        arrived = [(conv, done) for done in finished if (conv := self.active.pop(done.request_id, None)) is not None]
        for (conv, done), reply in zip(arrived, self._texts(arrived), strict=True):
            self._finished(conv, done, reply)

    def _texts(self, arrived: list[tuple[_Conv, Finished]]) -> list[_Reply | None]:
        """Each finished reply's ids (its stop token cut), text, and whether prompt + text encode back to the
        same ids; None for an engine error. One batch per step: the Rust tokenizer spreads it over the cores,
        where one call per reply ran serially after the step in which the replies ended."""
        ids: list[list[int] | None] = []
        for _, done in arrived:
            reply = list(done.token_ids) if done.finish_reason in ("stop", "length") else None
            if reply and done.finish_reason == "stop" and reply[-1] in self.stop_ids:
                reply = reply[:-1]  # the end-of-turn token: the template writes its own after the content
            ids.append(reply)
        kept = [i for i, reply in enumerate(ids) if reply is not None]
        texts = self.renderer.decode_batch([ids[i] for i in kept])
        again = self.renderer.encode_batch([arrived[i][0].prompt_text + t for i, t in zip(kept, texts, strict=True)])
        out: list[_Reply | None] = [None] * len(arrived)
        for i, text, enc in zip(kept, texts, again, strict=True):
            out[i] = _Reply(ids[i], text, enc == arrived[i][0].prompt_ids + ids[i])
        return out

    def _finished(self, conv: _Conv, done: Finished, reply: _Reply | None) -> None:
        """Account for one reply and decide: next turn, done, or quarantined."""
        replies, turn = self.tally.replies, len(conv.replies)
        replies["output_tokens"] += len(done.token_ids)
        if reply is None:
            replies["error"] += 1
            why = f": {done.detail}" if done.detail else ""
            self._quarantine(conv, "engine_error", f"reply {turn}: finish_reason {done.finish_reason}{why}")
            return
        replies[done.finish_reason] += 1
        if done.prompt_token_ids is not None and done.prompt_token_ids != conv.prompt_ids:
            # The reply answered other vision tokens than tokenize will write for this conversation.
            self._quarantine(
                conv, EXPANSION_DIFFERS,
                f"reply {turn}: vLLM's processor made {len(done.prompt_token_ids)} prompt tokens of tokenize's "
                f"{len(conv.prompt_ids)} (its images expanded differently)",
            )  # fmt: skip
            return
        ids, generated = reply.ids, reply.text
        pad = self.renderer.image_token_id
        if pad is not None and pad in ids and has_images(conv.record["messages"]):
            # The next prompt (and tokenize's row) would hold more placeholders than the conversation has images.
            self._quarantine(conv, "reply_has_image_token", f"reply {turn} wrote the image placeholder (id {pad})")
            return
        if not reply.same_ids:
            replies["retokenized_differently"] += 1
        message, split = reply_message(generated, conv.prefill, self.thinking)
        replies["with_thinking"] += split.thinking is not None
        replies["unterminated_thinking"] += split.thinking is not None and not split.terminated
        empty = is_empty(message)
        replies["empty"] += empty
        if done.finish_reason == "length" and self.settings.content.on_length == "quarantine":
            limit = self.settings.content.sampling.max_tokens
            self._quarantine(
                conv, "cut_by_max_tokens", f"reply {turn} reached max_tokens = {limit} (or max_model_len)"
            )
            return
        if empty and self.settings.content.on_empty == "quarantine":
            self._quarantine(conv, "empty_reply", f"reply {turn} is empty ({len(ids)} tokens before the stop token)")
            return
        conv.replies.append(message)
        conv.meta.append({"finish_reason": done.finish_reason, "tokens": len(done.token_ids)})
        if len(conv.replies) < len(conv.plan.steps):
            self._submit(conv)
        else:
            self._complete(conv)

    def _complete(self, conv: _Conv) -> None:
        messages = assemble(conv.plan, conv.replies)
        tools = conv.record.get("tools")
        conv.result = Conversation(
            conversation_id(messages, tools),  # the content hash of what tokenize will render
            messages,
            conv.record["source"],
            tools,
            regenerated={"from": conv.record["id"], "seed": conv.seed, "replies": conv.meta},
        )

    def _quarantine(self, conv: _Conv, reason: str, detail: str) -> None:
        conv.result = Quarantined(self.source, conv.line, reason, detail, conv.record)
