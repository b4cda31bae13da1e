"""The regenerate job: one prompt shard in, one shard folder out (results/regenerate/shard_{k}/):

    conversations.jsonl  the regenerated conversations (Conversation JSON, `regenerated` set), in input order
    quarantine.jsonl     the conversations that could not be regenerated, each with its reason (counts.REASONS)
    counts.json          rows in = kept + quarantined (checked), replies by how they ended
    timings.json         engine start, generation time, tokens/s (wall-clock facts, not in the manifest)
    manifest.json        written last, atomically: model, tokenizer and template hashes, the template kwargs,
                         engine, sampling and seed rule, turn mode, thinking plan, counts, sha256 of every file

A folder without manifest.json is not finished: Snakemake's incomplete marker redoes it, from its start.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from eagle3prep.errors import UserError
from eagle3prep.infra.atomic import atomic_open, sha256_file, write_json
from eagle3prep.infra.folder import file_entry, finish_folder, open_folder
from eagle3prep.infra.gpus import claim_job_gpus
from eagle3prep.infra.provenance import code_version, model_identity, tokenizer_identity
from eagle3prep.model_facts import ModelFacts
from eagle3prep.prepare.stage import quarantine_line
from eagle3prep.records import Quarantined
from eagle3prep.regenerate.counts import ShardTally, shard_counts, summarize
from eagle3prep.regenerate.prompts import PromptRenderer
from eagle3prep.regenerate.runner import Engine, Runner
from eagle3prep.regenerate.split import shard_entry
from eagle3prep.regenerate.thinking import resolve
from eagle3prep.settings import RegenerateSettings, TokenizeSettings
from eagle3prep.vllm.registry import version_text

from ..infra.log import get_logger

log = get_logger("regenerate")

CONVERSATIONS, QUARANTINE, COUNTS = "conversations.jsonl", "quarantine.jsonl", "counts.json"


class RegenerateError(UserError, ValueError):
    """A setting the model cannot honour (max_model_len); the message names the key and the fix."""


def model_len(settings: RegenerateSettings, model_path: str | os.PathLike, max_seq_len: int | None) -> int:
    """Tokens per request (prompt + reply): regenerate.max_model_len, else tokenize.max_seq_len (tokenize cuts a
    row there, so a token generated past it would be thrown away), capped by the model's context."""
    limit = ModelFacts.read(model_path).max_positions
    wanted = settings.content.max_model_len or max_seq_len
    if wanted is None:
        if limit is None:
            raise RegenerateError(
                f"{model_path}/config.json gives no context length (max_position_embeddings); set regenerate.max_model_len"
            )
        return limit
    if limit is not None and wanted > limit:
        if settings.content.max_model_len is None:
            return limit
        raise RegenerateError(
            f"regenerate.max_model_len = {wanted} is above the model's context of {limit} tokens; "
            f"set it to {limit} or less"
        )
    return wanted


@dataclass(frozen=True, slots=True)
class RegeneratePaths:
    """The regenerate job's files: prompt shard `shard` in, its folder out."""

    prompts_shard: str  # results/regenerate_prompts/shard_{k}.jsonl
    out_dir: str  # results/regenerate/shard_{k}
    model_path: str
    shard: int  # k


@dataclass(frozen=True, slots=True)
class RegenerateJobSettings:
    """What every regenerate job of a run reads: `regenerate:`, tokenize's template kwargs (the prompts render as
    tokenize renders the rows) and max_seq_len (regenerate.max_model_len's stand-in when null)."""

    regenerate: RegenerateSettings
    chat_template_kwargs: Mapping[str, Any]
    trust_remote_code: bool
    max_seq_len: int
    threads: int | None  # the job's Snakemake threads; None leaves torch's own

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, threads: int | None) -> Self:
        """From the config as it is now (the params only trigger reruns, RegenerateSettings.params), so a speed
        knob changed after a crash applies to the shards still to make."""
        tokenize = TokenizeSettings.from_config(config)
        return cls(RegenerateSettings.from_config(config), tokenize.chat_template_kwargs,
                   config["model"]["trust_remote_code"], tokenize.max_seq_len, threads)  # fmt: skip


def run_regenerate_job(paths: RegeneratePaths, settings: RegenerateJobSettings) -> dict[str, Any]:
    """The regenerate rule's job: claim GPUs, start vLLM, regenerate one shard; return its manifest."""
    from eagle3prep.regenerate.engine import VLLMEngine

    if settings.threads:  # the job's Snakemake threads (torch intra-op threads on a CPU engine)
        import torch

        torch.set_num_threads(settings.threads)
    regen, model_path, trust_remote_code = settings.regenerate, paths.model_path, settings.trust_remote_code
    renderer = PromptRenderer.load(model_path, trust_remote_code, dict(settings.chat_template_kwargs))
    max_model_len = model_len(regen, model_path, settings.max_seq_len)
    version = code_version()  # the code this shard starts with, before the engine's start-up
    t0 = time.time()
    if os.path.getsize(paths.prompts_shard) == 0:  # more shards than conversations: no engine for no request
        return regenerate_shard(
            paths.prompts_shard, paths.out_dir, _NoRequests(), renderer, regen,
            max_model_len=max_model_len, engine_info={**NO_ENGINE, "engine_version": version_text()},
            model_path=model_path, trust_remote_code=trust_remote_code, shard=paths.shard, code=version,
            started={"t0": t0},
        )  # fmt: skip
    with (
        claim_job_gpus(regen.content.tp_size),  # before vLLM reads CUDA_VISIBLE_DEVICES
        VLLMEngine(
            model_path,
            regen,
            regen.content.sampling,
            renderer.stop_token_ids(),
            max_model_len,
            trust_remote_code,
        ) as engine,
    ):
        info = engine.start()
        return regenerate_shard(
            paths.prompts_shard, paths.out_dir, engine, renderer, regen,
            max_model_len=max_model_len, engine_info=info, model_path=model_path,
            trust_remote_code=trust_remote_code, shard=paths.shard, code=version,
            started={"t0": t0, **engine.volatile},
        )  # fmt: skip


NO_ENGINE = {"engine": "vllm", "engine_started": False}  # an empty shard's manifest entry (+ the version)


class _NoRequests:
    """The engine of a shard without conversations: the runner never calls it."""

    def add(self, request_id: str, prompt_ids: list[int], seed: int) -> None:
        raise RuntimeError("regenerate: a shard without conversations sent a request")

    def step(self) -> list:
        raise RuntimeError("regenerate: a shard without conversations stepped the engine")

    def has_unfinished(self) -> bool:
        return False

    def abort(self, request_ids: list[str]) -> None:
        pass


def read_shard(path: str | os.PathLike, first_line: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number in the prepared file, conversation JSON) of each line of a prompt shard."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            yield first_line + i, json.loads(line)


def regenerate_shard(
    prompts_shard: str,
    out_dir: str,
    engine: Engine,
    renderer: PromptRenderer,
    settings: RegenerateSettings,
    *,
    max_model_len: int,
    engine_info: dict[str, Any],
    model_path: str,
    trust_remote_code: bool,
    shard: int,
    code: str | None = None,
    started: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Regenerate one prompt shard through a started `engine` into `out_dir`; return the manifest."""
    out = open_folder(out_dir)
    entry = shard_entry(prompts_shard)
    content = settings.content
    thinking = resolve(content.thinking, tuple(content.thinking_markers), renderer.render)
    stop_ids = renderer.stop_token_ids()
    log.info(
        f"shard {shard}: {entry['rows']} conversations (lines {entry['first_line']}.. of "
        f"{entry['source']}), turns {content.turns}, sampling {content.sampling.to_json()}, thinking {thinking.mode} "
        f"({thinking.form}: {thinking.why}), max_model_len {max_model_len}"
    )
    tally = ShardTally(str(prompts_shard))
    t_start = time.time()
    runner = Runner(engine, renderer, settings, thinking, stop_ids, max_model_len, entry["source"], tally, shard)
    written = _write_results(out, runner.run(read_shard(prompts_shard, entry["first_line"])), entry["rows"], shard)
    elapsed = time.time() - t_start
    counts = shard_counts(tally, written)
    write_json(out / COUNTS, counts)
    log.info(summarize(counts))
    manifest = {
        "stage": "regenerate",
        "shard": shard,
        "prompts": {
            "path": str(prompts_shard),
            "sha256": sha256_file(prompts_shard),
            **{k: entry[k] for k in ("first_line", "rows", "source")},
        },
        "files": {name: file_entry(out / name) for name in (CONVERSATIONS, QUARANTINE, COUNTS)},
        "counts": counts["totals"],
        "model": model_identity(model_path, trust_remote_code),
        "tokenizer": tokenizer_identity(model_path),  # tokenizer.json and chat-template hashes
        "chat_template_kwargs": renderer.chat_template_kwargs,  # the prompts were rendered with these too
        "engine": engine_info,
        "sampling": {**content.sampling.to_json(), "stop_token_ids": stop_ids, "max_model_len": max_model_len},
        "policy": content.policy_json(),
        "thinking": thinking.to_json(),
        "code_version": code or code_version(),
    }
    timings = _timings(counts, tally, runner, started, t_start, elapsed)
    finish_folder(out, manifest, timings, ("regenerate.before_manifest", {"shard": shard}))
    log.info(f"shard {shard}: done in {elapsed:.1f} s")
    return manifest


def _write_results(out: Path, results: Iterator[Any], rows: int, shard: int) -> dict[str, int]:
    """Each regenerated conversation or quarantine line into its file, in input order; {file: lines written}."""
    from tqdm import tqdm

    written = {"conversations": 0, "quarantine": 0}
    bar = tqdm(total=rows, unit="conv", file=sys.stderr, mininterval=1.0, desc=f"shard {shard}")
    with (
        atomic_open(out / CONVERSATIONS, "w", encoding="utf-8") as conv_f,
        atomic_open(out / QUARANTINE, "w", encoding="utf-8") as quar_f,
    ):
        for result in results:
            if isinstance(result, Quarantined):
                quar_f.write(quarantine_line(result))
                written["quarantine"] += 1
            else:
                conv_f.write(json.dumps(result.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n")
                written["conversations"] += 1
            bar.update(1)
        bar.close()
    return written


def _timings(counts, tally, runner, started, t_start, elapsed) -> dict[str, Any]:  # noqa: PLR0913
    """timings.json: the engine's start, the generation's time and rates (wall-clock facts, not in the manifest)."""
    replies = counts["totals"]["replies"]
    started = started or {}
    return {
        "engine_start_s": started.get("engine_start_s"),
        "job_start_to_generate_s": round(t_start - started["t0"], 3) if "t0" in started else None,
        "generate_s": round(elapsed, 3),
        "output_tokens_per_s": round(replies["output_tokens"] / elapsed, 1) if elapsed > 0 else None,
        "conversations_per_s": round(tally.rows_in / elapsed, 2) if elapsed > 0 else None,
        "engine_steps": runner.steps,
        "engine_step_s": round(runner.step_s, 3),  # in engine.step(); the rest: prompts, replies, files
        "gpu_ids": started.get("gpu_ids"),
    }
