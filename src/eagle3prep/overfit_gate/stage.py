"""The overfit gate job (`validate.overfit_gate`): a draft overfit on the target's own greedy replies to a
few prompts must, served by vLLM on the same prompts, accept nearly every drafted token.

Steps, in `work` (results/overfit_gate/): pick prompts of the first tokenized shard -> vLLM writes greedy
replies (the target alone) -> rows prompt + reply -> their hidden states through the run's own extract
path (extract.run_extract_job: the run's backend, layer ids and dtype) -> checksums (validate_shard,
reference off: shard 0's validation already compared this capture path with transformers) -> export
(direct) and speculators' trainer through eagle3prep-train, many steps -> vLLM serves the prompts with
the draft (eagle3, k drafted tokens, greedy) -> acceptance from its spec-decode counters (acceptance.py).
What a mistake in the target, the layer ids or the capture does to the draft's inputs shows up as drafted
tokens the target rejects, before any other shard's GPU hours depend on it.

Skipped, not failed (verdict "skipped: <reason>", one line): a target vLLM cannot serve with an EAGLE-3
draft, no vLLM or no trainer here, no prompt in the first shard.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self

from ..errors import UserError
from ..infra.atomic import write_json
from ..infra.gpus import claim_job_gpus
from ..infra.log import get_logger
from ..infra.provenance import code_version
from ..model_facts import ModelFacts
from ..settings import ExtractSettings, LayersSettings, RegenerateSettings, TokenizeSettings, ValidateSettings
from . import acceptance, rows, serve, train

FORMAT = "eagle3prep.overfit_gate/1"


class GateFailed(UserError):
    """The draft did not accept nearly every drafted token; the message has the numbers."""


@dataclass(frozen=True, slots=True)
class GateSettings:
    """The gate's size: small enough for a CPU test, and on a GPU a minute or two."""

    prompts: int = 4
    max_tokens: int = 32  # reply tokens measured per prompt when served with the draft
    k: int = 3  # num_speculative_tokens
    steps: int = 40  # optimizer steps, each a batch of about one copy of the rows
    copies: int = 5  # of each row in the training split: epochs of `copies` steps
    lr: float = 1e-2
    loss_fn: str = "ce"  # cross-entropy against the target's argmax: what greedy acceptance asks of the draft


def job_gpus(regenerate: RegenerateSettings, extract: ExtractSettings) -> int:
    """GPUs the gate holds: the engines' tensor-parallel size, or the capture's when it needs more
    (rules/overfit_gate.smk declares the same)."""
    if extract.content.backend == "vllm":
        capture = extract.content.tp_size
    else:
        capture = 1 if extract.content.device.startswith("cuda") else 0
    return max(regenerate.content.tp_size, capture)


def _first_difference(served: list[int], regenerated: list[int]) -> int | None:
    """The first reply position where the served reply leaves the regenerated one (None: it never does)."""
    return next((i for i, (a, b) in enumerate(zip(served, regenerated, strict=False)) if a != b), None)


log = get_logger("overfit_gate").info


def _skip(out_json: str, record: dict[str, Any], reason: str) -> dict[str, Any]:
    record.update(verdict=f"skipped: {reason}", ok=True, skipped=True)
    log(record["verdict"])
    write_json(out_json, record)
    return record


def _trainer(model_path: str, trust_remote_code: bool) -> tuple[str | None, str, str]:
    """(the trainer's Python, how it was found, why the gate cannot run here: "" when it can)."""
    blocker = serve.eagle3_blocker(model_path, trust_remote_code)
    if blocker:
        return None, "", blocker
    python, how = train.train_python()
    return python, how, "" if python is not None else f"no trainer: {how}"


def _prompts(tokenized_shard: str, facts: ModelFacts, s: GateSettings) -> tuple[list[rows.Prompt], int, int]:
    """The gate's prompts, the reply budget each is generated with, and the engines' max_model_len."""
    budget = s.max_tokens + s.k + 1  # trained on: serving drafts up to k tokens past the last one measured
    prompts = rows.pick_prompts(tokenized_shard, s.prompts, (facts.max_positions or 4096) - budget - s.k)
    return prompts, budget, max((len(p.ids) for p in prompts), default=0) + budget + s.k


@dataclass(frozen=True, slots=True)
class OverfitGatePaths:
    """The gate's files: shard 0's tokenized rows in, the verdict out, its work folder."""

    tokenized_shard: str  # results/tokenized/shard_0.jsonl
    out_json: str  # results/validation/overfit_gate.json
    work: str  # results/overfit_gate/
    model_path: str


@dataclass(frozen=True, slots=True)
class OverfitGateJobSettings:
    """What the gate reads: the run's capture (`layers:`, `extract:`), the engines' (`regenerate:`), the template's
    kwargs, and the gate's own size; `plant` (bench/overfit_gate.py) turns the captured shard into a wrong one
    before training, None in the workflow."""

    layers: LayersSettings
    extract: ExtractSettings
    regenerate: RegenerateSettings
    chat_template_kwargs: Mapping[str, Any]  # tokenize.chat_template_kwargs
    trust_remote_code: bool
    threads: int | None  # the job's Snakemake threads; None leaves torch's own
    size: GateSettings = GateSettings()
    plant: Callable[[Path], Path] | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, threads: int | None) -> Self:
        return cls(
            LayersSettings.from_config(config), ExtractSettings.from_config(config),
            RegenerateSettings.from_config(config), TokenizeSettings.from_config(config).chat_template_kwargs,
            config["model"]["trust_remote_code"], threads,
        )  # fmt: skip


def run_overfit_gate_job(paths: OverfitGatePaths, settings: OverfitGateJobSettings) -> dict[str, Any]:
    """The gate; writes `out_json` on a pass or a skip and raises GateFailed on a fail (the record then
    stays in `work`/overfit_gate.json)."""
    tokenized_shard, out_json, model_path = paths.tokenized_shard, paths.out_json, paths.model_path
    layers, extract, regenerate = settings.layers, settings.extract, settings.regenerate
    trust_remote_code, chat_template_kwargs = settings.trust_remote_code, settings.chat_template_kwargs
    s = settings.size
    t0 = time.time()
    work_dir = Path(paths.work)
    work_dir.mkdir(parents=True, exist_ok=True)
    facts = ModelFacts.read(model_path)
    ids = layers.capture_ids(facts.num_hidden_layers)
    record: dict[str, Any] = {"format": FORMAT, "model": model_path, "layer_ids": ids, "settings": asdict(s),
                              "bound": acceptance.bound(s.k), "code_version": code_version()}  # fmt: skip
    python, how, blocker = _trainer(model_path, trust_remote_code)
    if blocker:
        return _skip(out_json, record, blocker)
    record["trainer_python"] = how

    from ..regenerate.prompts import PromptRenderer

    stop_ids = PromptRenderer.load(model_path, trust_remote_code, dict(chat_template_kwargs)).stop_token_ids()
    prompts, budget, max_model_len = _prompts(tokenized_shard, facts, s)
    if not prompts:
        return _skip(out_json, record, f"no row of {tokenized_shard} has a prompt that leaves {budget} tokens")
    record["prompts"] = [{"row": p.row, "tokens": len(p.ids), "ids": p.ids} for p in prompts]
    ask = [p.ids for p in prompts]

    # The job's GPUs, claimed once before any engine reads CUDA_VISIBLE_DEVICES (extract_shard's own claim
    # then respects it); none on a host without NVIDIA GPUs.
    with claim_job_gpus(job_gpus(regenerate, extract)):
        log(f"{len(prompts)} prompts of {tokenized_shard}: the target's greedy replies ({budget} tokens each)")
        regen = serve.generate(model_path, regenerate, ask, budget, stop_ids, max_model_len, trust_remote_code)
        record["regenerate_engine"] = regen.engine
        gate_rows = rows.training_rows(prompts, regen.outputs, s.copies)
        files = _capture(work_dir, gate_rows, record, model_path, settings)
        job = _train_job(model_path, files, work_dir, gate_rows, len(prompts), ids, facts, s)
        record["training"] = _train_draft(job, python, work_dir, s, len(prompts))

        log(f"serving the prompts with the draft (eagle3, k = {s.k}, greedy, {s.max_tokens} tokens each)")
        try:
            served = serve.generate(model_path, regenerate, ask, s.max_tokens, stop_ids, max_model_len,
                                    trust_remote_code, draft=record["training"]["draft"], k=s.k)  # fmt: skip
        except serve.NotServable as e:
            return _skip(out_json, record, str(e))
        record.update(_judged(served, regen, len(prompts), s.k), wall_s=round(time.time() - t0, 1))
        return _finish(record, work_dir, out_json)


def _capture(work_dir: Path, gate_rows: list[dict[str, Any]], record: dict[str, Any], model_path: str,
             settings: OverfitGateJobSettings) -> dict[str, Any]:  # fmt: skip
    """Write the gate's rows, capture and validate their shard as the workflow would (planted, when asked):
    the files the trainer reads, as its job's entries."""
    tokenized, freq = work_dir / "rows/shard_0.jsonl", work_dir / "rows/token_freq.json"
    rows.write_rows(gate_rows, tokenized, freq)

    from ..extract import ExtractJobSettings, ExtractPaths, run_extract_job
    from ..validate import validate_shard

    shard = work_dir / "hidden_states/shard_0"
    longest = max(r["seq_len"] for r in gate_rows)
    capture = ExtractJobSettings(settings.extract, settings.layers, longest, settings.trust_remote_code,
                                 settings.threads)  # fmt: skip
    run_extract_job(ExtractPaths(str(tokenized), str(shard), model_path, shard=0), capture)
    if settings.plant is not None:
        shard = settings.plant(shard)
        record["planted"] = str(shard)
    validation = work_dir / "validation/shard_0.json"
    # the shard's own checks, without the reference forward (the gate's training is the end-to-end check); the
    # other validate.* values are the schema's, which do nothing without a reference
    v = ValidateSettings.defaults()
    validate_shard(str(shard), str(tokenized), str(validation), model_path, v.sample_rows, v.seed, v.device,
                   False, settings.trust_remote_code, v.windows)  # fmt: skip
    return {"shard": str(shard), "validation": str(validation), "tokenized": str(tokenized), "token_freq": str(freq)}


def _train_job(model_path: str, files: dict[str, str], work_dir: Path, gate_rows: list[dict[str, Any]],
               n_prompts: int, ids: list[int], facts: ModelFacts, s: GateSettings) -> dict[str, Any]:  # fmt: skip
    """The trainer's job (train.run) for the gate's rows: the files _capture wrote and the settings."""
    import torch

    return {
        "model": str(Path(model_path).resolve()), **files, "export": str(work_dir / "export"),
        "out": str(work_dir / "train"), "layer_ids": ids, "steps": s.steps, "lr": s.lr, "loss_fn": s.loss_fn,
        "draft_vocab_size": min(facts.vocab_size or train.MAX_DRAFT_VOCAB, train.MAX_DRAFT_VOCAB),
        "total_seq_len": sum(r["seq_len"] for r in gate_rows[:n_prompts]), "train_rows": len(gate_rows) - 1,
        "cpu": not torch.accelerator.is_available(),
    }  # fmt: skip


def _train_draft(job: dict[str, Any], python: str, work_dir: Path, s: GateSettings, n_prompts: int) -> dict[str, Any]:
    """Train the draft in the trainer's Python; its record, with the wall time."""
    t_train = time.time()
    log(
        f"training the draft: {s.steps} steps, {s.copies} copies of {n_prompts} rows ({job['total_seq_len']} tokens a batch)"
    )
    return {**train.run(job, python, work_dir / "train.log"), "wall_s": round(time.time() - t_train, 1)}


def _judged(served: Any, regen: Any, n_prompts: int, k: int) -> dict[str, Any]:
    """The served replies judged: acceptance over the prompts served as the target alone writes them."""
    first_diff = [_first_difference(o, r) for o, r in zip(served.outputs, regen.outputs, strict=True)]
    # Greedy decoding with a draft writes what the target alone writes, up to numerics (a near-tie decided
    # otherwise when k + 1 tokens are verified at once); past such a token the draft is off its training
    # rows, whatever the data. The draft cannot move the target's choice, so judging the other prompts
    # hides no mistake of the data.
    judged = [i for i, d in enumerate(first_diff) if d is None]
    acc = acceptance.acceptance(acceptance.total([served.spec[i] for i in judged]) or acceptance.zero(k), k)
    verdict, line = acceptance.verdict(acc, len(judged), n_prompts)
    return {
        "acceptance": acc.to_json(),
        "acceptance_all_prompts": acceptance.acceptance(acceptance.total(served.spec), k).to_json(),
        "per_prompt": [
            {
                "mean_acceptance_length": round(acceptance.acceptance(sp, k).mean_acceptance_length, 4),
                "first_difference": d,
                "spec_decode": sp,
            }
            for sp, d in zip(served.spec, first_diff, strict=True)
        ],
        "served_equal_to_regenerated": f"{len(judged)}/{n_prompts}",
        "replies": {"regenerated": regen.outputs, "served": served.outputs},
        "serve_engine": served.engine,
        "verdict": verdict,
        "detail": line,
        "ok": verdict == "pass",
    }


def _finish(record: dict[str, Any], work_dir: Path, out_json: str) -> dict[str, Any]:
    """Keep the record in `work_dir`; write `out_json` on a pass, raise GateFailed otherwise."""
    verdict, line = record["verdict"], record["detail"]
    write_json(work_dir / "overfit_gate.json", record)
    log(f"{verdict.upper()}: {line}")
    if verdict != "pass":
        log(json.dumps(record.get("acceptance"), indent=1))
        raise GateFailed(
            f"overfit gate failed: {line} (bound {acceptance.MIN_ACCEPTANCE_PER_POSITION} per position); the "
            f"record is {work_dir / 'overfit_gate.json'}: check layers.ids and the capture (docs/DESIGN.md §6a)"
        )
    write_json(out_json, record)
    return record
