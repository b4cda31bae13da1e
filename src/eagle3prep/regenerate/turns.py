"""Which replies the target writes, per turn mode: a conversation becomes a list of steps, each the dataset's
messages that precede one generated reply.

    turns: all   every assistant block that answers a user message is replaced by the target's reply, given the
                 conversation so far with the target's own earlier replies; a conversation ending with a user
                 message gets a reply appended (so prompt-only records work). An assistant block before the first
                 user message (a greeting after the system prompt) answers nobody and is kept as it is.
    turns: last  only the final assistant block is replaced (or a reply appended after a final user or tool
                 message); the earlier turns keep the dataset's text, tool calls and results included.

The conversation that comes out is steps[0] + [reply 0] + steps[1] + [reply 1] + ... System prompts are kept.
With `turns: all`, a conversation with tool calls or tool results is rejected ("tool_turns"): its tool results
answer the dataset's calls, not the calls the target would make; `turns: last` keeps them as context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3prep.tokenize.template import has_tool_turns


@dataclass(slots=True)
class Rejection:
    """A conversation the stage cannot regenerate: a REASONS reason of regenerate.counts and a sentence."""

    reason: str
    detail: str


@dataclass(slots=True)
class TurnPlan:
    """steps[i]: the dataset's messages that come before generated reply i (after reply i-1)."""

    steps: list[list[dict[str, Any]]]
    replaced: int  # assistant messages of the dataset that the replies replace


def plan_turns(messages: list[dict[str, Any]], mode: str) -> TurnPlan | Rejection:
    """The steps of one conversation in turn mode `mode` ("all" or "last"), or why it cannot be regenerated."""
    if not any(m["role"] == "user" for m in messages):
        roles = ", ".join(sorted({m["role"] for m in messages})) or "none"
        return Rejection("no_user_turn", f"no user message to reply to (roles: {roles})")
    if mode == "last":
        return _plan_last(messages)
    if mode != "all":
        raise ValueError(f"regenerate.turns = {mode!r}; choose one of ['all', 'last']")
    if has_tool_turns(messages):
        return Rejection(
            "tool_turns",
            "tool calls or tool results: they answer the dataset's calls, not the target's "
            "(regenerate.turns: last regenerates only the final reply and keeps them as context)",
        )
    return _plan_all(messages)


def _plan_all(messages: list[dict[str, Any]]) -> TurnPlan:
    steps: list[list[dict[str, Any]]] = []
    context: list[dict[str, Any]] = []
    replaced = 0
    answering = False  # a user message came since the last reply: the next assistant block is replaced
    for m in messages:
        if m["role"] != "assistant":
            context.append(m)
            answering = answering or m["role"] == "user"
        elif answering:  # the first message of an assistant block that answers a user: a step ends here
            steps.append(context)
            context, answering = [], False
            replaced += 1
        elif steps and not context:  # a later message of the same block: replaced with it
            replaced += 1
        else:  # an assistant block before the first user message answers nobody: kept as it is
            context.append(m)
    if answering:  # the conversation ends with user messages: a reply is appended
        steps.append(context)
    return TurnPlan(steps, replaced)


def _plan_last(messages: list[dict[str, Any]]) -> TurnPlan:
    end = len(messages)
    while end > 0 and messages[end - 1]["role"] == "assistant":
        end -= 1
    return TurnPlan([list(messages[:end])], len(messages) - end)


def context_before(plan: TurnPlan, replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages before reply len(replies): the steps so far, each followed by its generated reply."""
    out: list[dict[str, Any]] = []
    for step, reply in zip(plan.steps, [*replies, None], strict=False):
        out += step
        if reply is None:
            break
        out.append(reply)
    return out


def assemble(plan: TurnPlan, replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The regenerated conversation: every step followed by its reply."""
    if len(replies) != len(plan.steps):
        raise ValueError(f"{len(replies)} replies for {len(plan.steps)} steps")
    out: list[dict[str, Any]] = []
    for step, reply in zip(plan.steps, replies, strict=True):
        out += [*step, reply]
    return out
