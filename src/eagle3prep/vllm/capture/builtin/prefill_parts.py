"""Scheduler side of the built-in path's parts (connector.py): a row's prompt prefilled over several steps is
handed out as it goes. Each step's scheduler output (build_connector_meta's argument: block tables, computed
and scheduled tokens) says what the running prefills computed before it; those rows go to the worker as a
`PartSave` in the step's connector metadata, and the request's final save takes only the rest.

Anything but plain progress (a request preempted and recomputed into new blocks, or scheduled from its start
again) stops that request's parts; a scheduler output they cannot read stops all of them. Either way the final
save, whose block table is vLLM's own, takes every row from where the last part ended. Nothing here raises into
the engine: a raise in the scheduler kills it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ....infra.log import get_logger
from ....shard.sink import PROBE_SUFFIX
from ..requests import request_tag

log = get_logger("vllm connector")


@dataclasses.dataclass
class PartSave:
    """Rows [start, end) of a request still being prefilled, all in the hidden-states cache before the step
    that carries this (connector metadata `e3p_parts`)."""

    req_id: str
    e3p_tag: str
    start: int
    end: int
    block_ids: list[int]


@dataclasses.dataclass
class Live:
    """A row's request being prefilled, and how much of it was handed out already."""

    tag: str
    prompt_len: int
    blocks: list[int]
    expect: int  # its num_computed_tokens at the next step, if nothing but progress happened
    saved: int = 0
    streaming: bool = True  # off once anything else happened: the final save takes the rest

    def stop(self, why: str) -> None:
        if self.streaming:
            self.streaming = False
            log.info(f"row {self.tag}: {why}; rows {self.saved}+ go with its final save")


class PrefillParts:
    """The rows being prefilled (scheduler side), and the parts each step hands out."""

    def __init__(self) -> None:
        self.live: dict[str, Live] = {}
        self.on = True  # off after a scheduler output the parts could not read

    def finished(self, req_id: str) -> int:
        """A request finished (or was aborted): the rows of it already handed out in parts."""
        live = self.live.pop(req_id, None)
        return live.saved if live is not None else 0

    def step(self, out: Any, group: int, block_size: int) -> list[PartSave]:
        """This step's parts; none from now on if `out` cannot be read (one line)."""
        if not self.on:
            return []
        saved = {rid: live.saved for rid, live in self.live.items()}
        try:
            return self._parts(out, group, block_size)
        except Exception as e:  # a raise here would kill the engine: whole requests from now on
            self.on = False
            for rid, live in self.live.items():  # what this step's lost parts held goes with the final save
                live.saved, live.streaming = saved.get(rid, 0), False
            log.info(f"parts off, whole requests from now on: {type(e).__name__}: {e}")
            return []

    def _parts(self, out: Any, group: int, block_size: int) -> list[PartSave]:
        scheduled = out.num_scheduled_tokens
        for r in out.scheduled_new_reqs:
            if r.req_id in self.live:
                self.live[r.req_id].stop("scheduled again from its start")
                continue
            tag = request_tag(r.sampling_params)
            if tag is None or tag.endswith(PROBE_SUFFIX) or r.num_computed_tokens or r.prompt_token_ids is None:
                continue  # not a shard row, or a prefix from the cache (its hidden states were never computed)
            blocks = list(r.block_ids[group])
            self.live[r.req_id] = Live(tag, len(r.prompt_token_ids), blocks, scheduled.get(r.req_id, 0))
        parts = []
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            live = self.live.get(rid)
            if live is None or not live.streaming:
                continue
            done = cached.num_computed_tokens[i]
            if done != live.expect:  # preempted, or anything but plain progress
                live.stop(f"{done} tokens computed where {live.expect} were due (preempted?)")
                continue
            new = cached.new_block_ids[i]
            if new is not None:
                live.blocks.extend(new[group])
            live.expect = done + scheduled.get(rid, 0)
            end = min(done, live.prompt_len)
            if end > live.saved:
                parts.append(PartSave(rid, live.tag, live.saved, end, live.blocks[: -(-end // block_size)]))
                live.saved = end
        return parts
