"""The one stage contract: every `run_<stage>_job` takes `(paths, settings)`, a frozen `<Stage>Paths` of the job's
files and one frozen `<Stage>JobSettings` that its script builds with `from_config(snakemake.config, ...)`; and
the entries, called so on the demo model and a few demo conversations, write what their stage promises."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

from eagle3prep.config import validate_config

from testkit.workflow import REPO

DEMO_DATA = REPO / "resources" / "demo" / "sharegpt.jsonl"

# stage -> (module of its entry, its paths class, its settings class); the script is scripts/<stage>.py
ENTRIES = {
    "prepare": ("eagle3prep.prepare.stage", "PreparePaths", "PrepareJobSettings"),
    "tokenize": ("eagle3prep.tokenize.stage", "TokenizePaths", "TokenizeJobSettings"),
    "regenerate": ("eagle3prep.regenerate.stage", "RegeneratePaths", "RegenerateJobSettings"),
    "extract": ("eagle3prep.extract.stage", "ExtractPaths", "ExtractJobSettings"),
    "validate": ("eagle3prep.validate.stage", "ValidatePaths", "ValidateJobSettings"),
    "overfit_gate": ("eagle3prep.overfit_gate.stage", "OverfitGatePaths", "OverfitGateJobSettings"),
    "export": ("eagle3prep.export.speculators", "ExportPaths", "ExportJobSettings"),
    "report": ("eagle3prep.report", "ReportPaths", "ReportJobSettings"),
    "plan": ("eagle3prep.plan.stage", "PlanPaths", "PlanJobSettings"),
    "verify": ("eagle3prep.verify", "VerifyPaths", "VerifyJobSettings"),
}


def is_frozen_dataclass(cls: type) -> bool:
    return dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen


@pytest.mark.parametrize("stage", sorted(ENTRIES))
def test_every_entry_takes_its_paths_and_one_settings_object(stage):
    module, paths_name, settings_name = ENTRIES[stage]
    m = importlib.import_module(module)
    entry = getattr(m, f"run_{stage}_job")
    params = inspect.signature(entry).parameters
    assert [(p.name, p.annotation, p.kind) for p in params.values()] == [
        ("paths", paths_name, inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("settings", settings_name, inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ], f"run_{stage}_job{inspect.signature(entry)}"
    paths, settings = getattr(m, paths_name), getattr(m, settings_name)
    assert is_frozen_dataclass(paths) and is_frozen_dataclass(settings)
    assert inspect.ismethod(settings.from_config), f"{settings_name}.from_config"


@pytest.mark.parametrize("stage", sorted(ENTRIES))
def test_every_script_builds_the_paths_and_the_settings_from_the_config_and_calls_the_entry(stage):
    """One call a script, the same in each: run_<stage>_job(paths, <Stage>JobSettings.from_config(config, ...))."""
    _, paths_name, settings_name = ENTRIES[stage]
    scripts = [REPO / "scripts" / f"{stage}.py"]
    if stage == "prepare":  # the regenerate stage's prepare calls the same entry
        scripts.append(REPO / "scripts" / "prepare_prompt_only.py")
    for script in scripts:
        text = script.read_text(encoding="utf-8")
        calls = [
            node
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == f"run_{stage}_job"
        ]
        assert len(calls) == 1, script.name
        assert ast.unparse(calls[0].args[0]) == "paths" and not calls[0].keywords, script.name
        settings = ast.unparse(calls[0].args[1])
        assert re.match(rf"{settings_name}\.from_config\(snakemake\.config\b", settings), script.name
        assert re.search(rf"\bpaths = {paths_name}\(", text), script.name


@pytest.fixture(scope="module")
def run(demo_model_dir, tmp_path_factory):
    """prepare -> tokenize -> extract -> validate -> export -> report -> verify -> plan, each through its entry with
    the settings its script would build, on 12 demo conversations in two shards."""
    from eagle3prep.export import ExportJobSettings, ExportPaths, run_export_job
    from eagle3prep.extract import ExtractJobSettings, ExtractPaths, run_extract_job
    from eagle3prep.plan.stage import PlanJobSettings, PlanPaths, run_plan_job
    from eagle3prep.prepare import PrepareJobSettings, PreparePaths, run_prepare_job
    from eagle3prep.report import ReportJobSettings, ReportPaths, run_report_job
    from eagle3prep.tokenize import TokenizeJobSettings, TokenizePaths, run_tokenize_job
    from eagle3prep.validate import ValidateJobSettings, ValidatePaths, run_validate_job
    from eagle3prep.verify import VerifyJobSettings, VerifyPaths, run_verify_job

    root = tmp_path_factory.mktemp("entries")
    res = root / "results"
    source = root / "chats.jsonl"
    source.write_text("".join(DEMO_DATA.read_text(encoding="utf-8").splitlines(keepends=True)[:12]), encoding="utf-8")
    config = validate_config({
        "data": {"sources": [str(source)]},
        "model": {"path": str(demo_model_dir)},
        "tokenize": {"max_seq_len": 128, "num_shards": 2},
        "extract": {"backend": "hf", "device": "cpu", "dtype": "float32", "batch_tokens": 1024},
        "validate": {"sample_rows": 2},
        "export": {"speculators": True, "hidden_states": "copy"},
    })  # fmt: skip
    model, k = str(demo_model_dir), range(2)
    out = {"config": config, "root": root}

    prepared = res / "prepared"
    prepared.mkdir(parents=True)
    p = PreparePaths(prepared / "conversations.jsonl", prepared / "quarantine.jsonl", prepared / "counts.json",
                     root / "prepare.log")  # fmt: skip
    out["prepare"] = run_prepare_job(p, PrepareJobSettings.from_config(config, allow_prompt_only=False))

    tokenized = res / "tokenized"
    shards = [str(tokenized / f"shard_{i}.jsonl") for i in k]
    t = TokenizePaths(p.out_conversations, p.out_counts, p.out_quarantine, str(tokenized), shards, model)
    out["tokenize"] = run_tokenize_job(t, TokenizeJobSettings.from_config(config, workers=1))

    dirs = [str(res / f"hidden_states/shard_{i}") for i in k]
    validations = [str(res / f"validation/{i}.json") for i in k]
    extract = ExtractJobSettings.from_config(config, threads=1)
    out["extract"] = [run_extract_job(ExtractPaths(shards[i], dirs[i], model, shard=i), extract) for i in k]
    (res / "validation").mkdir()
    validate = ValidateJobSettings.from_config(config)
    out["validate"] = [run_validate_job(ValidatePaths(dirs[i], shards[i], validations[i], model), validate) for i in k]

    freq = str(tokenized / "token_freq.json")
    export = ExportPaths(dirs, validations, shards, freq, str(res / "export/speculators"))
    out["export"] = run_export_job(export, ExportJobSettings.from_config(config))

    report = ReportPaths(validations, dirs, shards, str(p.out_counts), str(tokenized / "stats.json"),
                         freq, [str(root / f"bench_{i}.tsv") for i in k],
                         str(res / "report/report.html"),
                         str(res / "report/summary.csv"), str(res / "report/dataset_manifest.json"),
                         export_dir=export.out_dir, model_dir=model)  # fmt: skip
    (res / "report").mkdir()
    out["report"] = run_report_job(report, ReportJobSettings.from_config(config))

    verify = VerifyPaths(res, root / "verify.log")
    out["verify"] = run_verify_job(verify, VerifyJobSettings.from_config(config, threads=2))

    plan = PlanPaths(tokenized, res / "hidden_states", root / "plan.json", root / "plan.txt", model)
    out["plan"] = run_plan_job(plan, PlanJobSettings.from_config(config, gpus_per_job=1))
    return out


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def test_prepare_and_tokenize_entries_write_the_conversations_and_contiguous_shards(run):
    res = run["root"] / "results"
    counts = json.loads((res / "prepared/counts.json").read_text())
    assert counts == run["prepare"] and counts["totals"]["rows_in"] == 12
    kept = jsonl(res / "prepared/conversations.jsonl")
    assert len(kept) == counts["totals"]["kept"] > 0

    stats = json.loads((res / "tokenized/stats.json").read_text())
    assert stats == run["tokenize"] and stats["max_seq_len"] == 128
    rows = [r for i in range(2) for r in jsonl(res / f"tokenized/shard_{i}.jsonl")]
    assert [r["row"] for r in rows] == list(range(stats["rows"]))
    assert stats["rows"] + stats["quarantined_total"] == len(kept)
    assert all(r["seq_len"] == len(r["input_ids"]) == len(r["loss_mask"]) <= 128 for r in rows)
    assert [s["rows"] for s in stats["shards"]] == [len(jsonl(res / f"tokenized/shard_{i}.jsonl")) for i in range(2)]


def test_extract_and_validate_entries_write_shards_that_pass_the_reference(run, demo_model_dir):
    from eagle3prep.model_facts import ModelFacts
    from eagle3prep.settings import LayersSettings

    res = run["root"] / "results"
    ids = LayersSettings.from_config(run["config"]).capture_ids(ModelFacts.read(str(demo_model_dir)).num_hidden_layers)
    stats = json.loads((res / "tokenized/stats.json").read_text())
    for k, (manifest, report) in enumerate(zip(run["extract"], run["validate"], strict=True)):
        shard = res / f"hidden_states/shard_{k}"
        assert (shard / "manifest.json").is_file() and manifest.layer_ids == ids and manifest.dtype == "float32"
        assert manifest.tokens == stats["shards"][k]["tokens"] and sorted(shard.glob("layer_*.safetensors"))
        assert report["ok"] and report["reference_mode"] == "full" and report["reference_sample"]["rows"] == 2
        assert json.loads((res / f"validation/{k}.json").read_text())["ok"]


def test_export_report_verify_and_plan_entries_read_the_shards(run):
    res = run["root"] / "results"
    stats = json.loads((res / "tokenized/stats.json").read_text())
    export = run["export"]
    assert (export["rows"], export["tokens"], export["hidden_states"]) == (stats["rows"], stats["tokens"], "copy")
    assert json.loads((res / "export/speculators/manifest.json").read_text()) == export
    assert len(list((res / "export/speculators/hidden_states").glob("*.safetensors"))) == stats["rows"]

    dataset = run["report"]
    assert dataset["rows"] == stats["rows"] and len(dataset["shards"]) == 2
    assert json.loads((res / "report/dataset_manifest.json").read_text()) == dataset
    assert (res / "report/summary.csv").read_text().count("\n") == 3  # a header and a line a shard
    assert (res / "report/report.html").stat().st_size > 0

    verdict = run["verify"]  # a healthy folder: nothing recorded for the next run to redo
    assert verdict.ok and verdict.shards == 2 and verdict.export_files > 0 and not (res / "verify.json").exists()
    assert (run["root"] / "verify.log").read_text().startswith("verify: ok: ")

    plan = json.loads((run["root"] / "plan.json").read_text())
    assert (plan["num_shards"], plan["rows"], plan["tokens"]) == (2, stats["rows"], stats["tokens"])
    assert plan["bytes_to_write"] == 0  # both shards are done: they have their manifests
    assert run["plan"].startswith(f"eagle3prep plan: 2 shards, {stats['rows']} rows")
