"""The plan stage's job: the bill of a config, from its tokenized shards, written to .eagle3prep/plan/ and shown.

A plan changes nothing under results/. It reads results/tokenized when those are this config's shards (or makes
them there through Snakemake in a folder that has none yet: the run's own first step); for another config it
prepares and tokenizes into a scratch folder of its own (.eagle3prep/plan/tokenized-<hash>, made once and reused),
so pricing a what-if redoes no finished shard (made_by.plan_source says which).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from ..config import ConfigError, reference_mode
from ..config.model import model_layer_ids
from ..drafts import plan_drafts
from ..infra.log import get_logger
from ..model_facts import ModelFacts, require_hidden_size
from ..settings import LayersSettings, PlanSettings, Settings
from ..shard.formats import MODEL_DTYPE, storage_format
from . import bill
from .estimate import make_plan, shard_sizes_from_stats, write_plan

log = get_logger("plan")


@dataclass(frozen=True, slots=True)
class PlanPaths:
    """The plan job's files. `tokenized`: the folder whose stats.json is planned; `prepared`: given when the plan
    makes that folder itself (a scratch folder, never under results/), from the conversations there (made too
    when they are missing)."""

    tokenized: str | os.PathLike
    hidden_states_dir: str | os.PathLike
    json_path: str | os.PathLike
    txt_path: str | os.PathLike
    model_path: str
    prepared: str | os.PathLike | None = None


@dataclass(frozen=True, slots=True)
class PlanJobSettings:
    """What the plan reads: the whole config (layers, extract's dtype and storage, plan, validate, export), and
    `gpus_per_job`, what one extract job holds (common.smk get_gpus)."""

    config: Settings
    gpus_per_job: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, gpus_per_job: int) -> Self:
        return cls(Settings.from_config(config), gpus_per_job)


def run_plan_job(paths: PlanPaths, settings: PlanJobSettings) -> str:
    """The `plan` rule's job: the extract jobs planned from the config, written to the plan's two files; its
    text returned."""
    s, model_path, tokenized = settings.config, paths.model_path, paths.tokenized
    redo = None
    if paths.prepared is not None:
        make_scratch_tokenized(tokenized, paths.prepared, model_path=model_path, settings=s)
        redo = "made from other tokenized shards (a data, model, tokenize or regenerate key differs)"
    return plan_run(
        Path(tokenized, "stats.json"), paths.hidden_states_dir, paths.json_path, paths.txt_path,
        model_path=model_path, layers=s.layers, dtype=s.extract.content.dtype, storage=s.extract.content.storage,
        plan=s.plan, reference=s.validate.reference, windows=s.validate.windows, validate_device=s.validate.device,
        sample_rows=s.validate.sample_rows, gpus_per_job=settings.gpus_per_job,
        export_copy=s.export.speculators and s.export.hidden_states == "copy", redo=redo,
    )  # fmt: skip


def make_scratch_tokenized(tokenized: str | os.PathLike, prepared: str | os.PathLike, *, model_path: str,
                           settings: Settings) -> None:  # fmt: skip
    """Another config's tokenized shards, in a folder of the plan's own: made once (each folder appears whole, by
    a rename), reused while it is there; `prepared` too unless it holds counts.json already."""
    tokenized, prepared = Path(tokenized), Path(prepared)
    results = Path("results").resolve()
    if tokenized.resolve().is_relative_to(results) or (
        prepared.resolve().is_relative_to(results) and not (prepared / "counts.json").is_file()
    ):
        raise ValueError(f"the plan writes nothing under results/: {tokenized}, {prepared}")
    if (tokenized / "stats.json").is_file():
        return
    if settings.regenerate.workflow.enabled:
        raise ConfigError(
            "plan: this config's conversations come from the regenerate stage (regenerate.enabled) and differ from "
            "the ones in results/; plan it in another folder, where that stage runs first: "
            "snakemake plan --directory OTHER_FOLDER"
        )
    from ..prepare import PrepareJobSettings, PreparePaths, run_prepare_job
    from ..tokenize import TokenizeJobSettings, TokenizePaths, run_tokenize_job

    if not (prepared / "counts.json").is_file():
        log.info(f"plan: preparing this config's conversations in {prepared} (results/ is left as it is)")
        tmp = _fresh(prepared.with_name(prepared.name + ".tmp"))
        run_prepare_job(
            PreparePaths(
                tmp / "conversations.jsonl", tmp / "quarantine.jsonl", tmp / "counts.json", tmp / "prepare.log"
            ),
            PrepareJobSettings(settings.data, allow_prompt_only=False),
        )
        _replace(tmp, prepared)
    log.info(f"plan: tokenizing this config's conversations in {tokenized} (results/ is left as it is)")
    tmp = _fresh(tokenized.with_name(tokenized.name + ".tmp"))
    shards = [tmp / f"shard_{k}.jsonl" for k in range(settings.tokenize.num_shards)]
    paths = TokenizePaths(prepared / "conversations.jsonl", prepared / "counts.json", prepared / "quarantine.jsonl",
                          tmp, shards, model_path)  # fmt: skip
    run_tokenize_job(paths, TokenizeJobSettings(settings.tokenize, settings.model.trust_remote_code, workers=1))
    _replace(tmp, tokenized)


def _fresh(folder: Path) -> Path:
    """An empty folder (what a killed plan left there is dropped)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def _replace(tmp: Path, folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def plan_run(
    stats_path: str | os.PathLike,
    hidden_states_dir: str | os.PathLike,
    json_path: str | os.PathLike,
    txt_path: str | os.PathLike,
    *,
    model_path: str,
    layers: LayersSettings,
    dtype: str,
    storage: str | None,
    plan: PlanSettings,
    reference: bool | str,
    windows: Sequence[Sequence[int]] | None,
    validate_device: str,
    sample_rows: int | str,
    gpus_per_job: int = 1,
    export_copy: bool = False,
    redo: str | None = None,
) -> str:
    """The `plan` rule: plan the extract jobs of these config values (validated), write the plan, return its text.

    layers: the config's `layers` section; plan: its `plan` section; windows, reference: validate.windows and
    validate.reference (what the scalable reference loads is planned only when it is the one that runs);
    export_copy: export.speculators with export.hidden_states copy (every hidden-state byte once more);
    validate_device: validate.device, where the validation's reference forward runs; sample_rows:
    validate.sample_rows, the rows whose tokens the reference recomputes (the validation estimate's); redo: why
    every finished shard is extracted again, when the plan's tokenized shards are not results/'s."""
    fmt = storage_format(storage or MODEL_DTYPE)  # extract.storage, resolved once for the whole plan
    ids = model_layer_ids(model_path, layers.ids, layers.convention, layers.drafts)
    try:
        hidden_size = require_hidden_size(ModelFacts.read(model_path), model_path)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sizes = shard_sizes_from_stats(stats_path)
    # Finished shards' own timings (timings.json) over the config's guess.
    meas = bill.measured(sizes, hidden_states_dir)
    result = make_plan(
        sizes,
        num_layers=len(ids),
        hidden_size=hidden_size,
        dtype=dtype,
        storage=fmt,
        hidden_states_dir=hidden_states_dir,
        tokens_per_s=meas["tokens_per_s"] or plan.tokens_per_s,
        engine_start_s=meas["engine_start_s"] if meas["engine_start_s"] is not None else plan.engine_start_s,
        gpus_per_job=gpus_per_job,
        made_with={
            "layer_ids": ids,
            "dtype": dtype,
            "storage": fmt.name,
            "model_path": model_path,
            "tokenized": Path(stats_path).parent,
            "redo": redo,
        },
    )
    if reference_mode(reference) == "scalable":
        result["validation_memory"] = validation_memory(model_path, ids, windows)
    result["measured"] = meas
    result["tokens_per_s_config"] = plan.tokens_per_s
    result["bill"] = bill.disk(result, export_copy, Path(hidden_states_dir).parent)
    mode = reference_mode(reference)
    estimate = bill.validate_estimate(result, bill.model_weights(model_path), sample_rows, mode, validate_device)
    root = Path(hidden_states_dir).parent.parent  # the working directory: logs/ and benchmarks/ beside results/
    result["bill_lines"] = [
        "",
        bill.disk_line(result["bill"], result["free_bytes"], bill.du(root / "logs") + bill.du(root / "benchmarks")),
        *bill.time_lines(result, meas, validate_device, mode != "off", estimate),
    ]
    if layers.drafts:  # each draft's layers and the bytes it reads
        per_layer = fmt.token_bytes(hidden_size, dtype)
        result["drafts"], lines = plan_drafts(layers.drafts, ids, per_layer, result["tokens"])
        result["bill_lines"] += ["", *lines]
    return write_plan(result, json_path, txt_path)


def validation_memory(model_path: str, ids: list[int], windows: list[list[int]] | None) -> dict[str, Any] | None:
    """What validate.reference scalable loads, from the model's config.json shapes: the logits check
    (final norm + lm_head) and the largest window (its layers at bf16); None when the shapes cannot be read."""
    from ..validate.scalable import check_memory

    windows = windows or ([ids[-2:]] if len(ids) >= 2 else [])
    try:
        mem = check_memory(model_path, ids, [tuple(w) for w in windows])
    except (ValueError, KeyError, OSError) as e:  # an architecture transformers does not know
        return {"error": str(e)[:300]}
    return {k: mem[k] for k in ("logits_bytes", "window_bytes", "largest_window", "layer_peak_bytes")}
