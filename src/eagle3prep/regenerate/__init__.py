"""The regenerate stage (opt-in, `regenerate.enabled`): on-policy data. The target writes the assistant replies
itself, so the draft learns from the distribution it will be asked to predict when served (docs/DESIGN.md §3a).

    prepare -> regenerate_split -> regenerate (one GPU job per shard, vLLM) -> regenerate_merge -> tokenize

Its settings are settings.RegenerateSettings (regenerate.*, typed, built once from the validated config).
Modules, in the order a conversation meets them:
    split     the prepared conversations cut into contiguous prompt shards (split.json)
    turns     which replies are generated per turn mode (all | last), and the conversation put back together
    prompts   prompts as token ids with the target's chat template, as tokenize renders it; replies decoded
    thinking  the thinking text of reasoning models: kept as the template reads it, or stripped
    runner    the loop over an engine: requests streamed turn after turn, finish reasons accounted, results in
              input order
    engine    vLLM as the runner's engine (started and failing in one line like the extract backend)
    counts    quarantine REASONS, reply counts, counts.json in prepare's shape and its check
    stage     the job: one prompt shard -> a shard folder with its manifest written last
    merge     the shards -> results/regenerated/ (what tokenize reads), each checked against its manifest
    review    N regenerated conversations beside their originals, before extraction
"""

from eagle3prep.regenerate.counts import REASONS, REPLY_KEYS, ShardTally, merged_counts, shard_counts, summarize
from eagle3prep.regenerate.merge import ShardError, merge_shards
from eagle3prep.regenerate.prompts import PromptRenderer
from eagle3prep.regenerate.runner import Engine, Finished, RequestRejected, Runner
from eagle3prep.regenerate.split import split_conversations
from eagle3prep.regenerate.stage import (
    RegenerateError,
    RegenerateJobSettings,
    RegeneratePaths,
    regenerate_shard,
    run_regenerate_job,
)
from eagle3prep.regenerate.thinking import ThinkingPlan, prompt_prefill, reply_message, resolve, split_thinking
from eagle3prep.regenerate.turns import Rejection, TurnPlan, assemble, plan_turns
from eagle3prep.settings import RegenerateSettings, Sampling, conversation_seed

__all__ = [
    "REASONS",
    "REPLY_KEYS",
    "Engine",
    "Finished",
    "PromptRenderer",
    "RegenerateError",
    "RegenerateJobSettings",
    "RegeneratePaths",
    "RegenerateSettings",
    "Rejection",
    "RequestRejected",
    "Runner",
    "Sampling",
    "ShardError",
    "ShardTally",
    "ThinkingPlan",
    "TurnPlan",
    "assemble",
    "conversation_seed",
    "merge_shards",
    "merged_counts",
    "plan_turns",
    "prompt_prefill",
    "regenerate_shard",
    "reply_message",
    "resolve",
    "run_regenerate_job",
    "shard_counts",
    "split_conversations",
    "split_thinking",
    "summarize",
]
