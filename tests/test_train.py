"""Training without the export copy (issue #14 items 3, 4): speculators' own trainer on the demo data, once
from a copy export (hs files, speculators' `file` backend) and once from a direct export (no hs files, our
`eagle3prep` backend reading the shard folders); the losses must be identical."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_export import export_inputs, finished_results

from eagle3prep.export import export_speculators

from testkit import calls
from testkit.shards import DEMO_LAYER_IDS
from testkit.workflow import REPO, snakemake

pytest.importorskip("speculators.train.cli", reason="speculators 0.9.0: make .venv/.installed")

from eagle3prep.settings import ExtractSettings
from eagle3prep.train.backend import Eagle3PrepBackend, ShardTransfer  # noqa: E402
from eagle3prep.train.rows import ExportRows, ExportRowsError  # noqa: E402

from testkit.shards import with_settings
from testkit.train_both import Recipe, cpu_runner, make_exports, train_both  # noqa: E402  (speculators_cpu needs speculators)

STEPS = 6
# a 1-layer draft over 64 draft tokens, 128-token batches
RECIPE = Recipe(seq_len=128, draft_vocab_size=64, ratio=0.97)


def train_both_ways(workdir: Path, model: Path, out: Path) -> dict:
    """Both exports of a finished workflow run, then speculators' trainer (eagle3, eager loss, sdpa attention,
    a 1-layer draft) for STEPS steps from each; the summary."""
    exports = make_exports(workdir, out / "exports")
    return train_both(model, exports, out, STEPS, RECIPE, cpu_runner())


@pytest.fixture(scope="module")
def demo(small_demo_run, tmp_path_factory) -> dict:
    """The demo workflow's results (3 shards, 181 rows, bf16) trained on both ways."""
    out = tmp_path_factory.mktemp("train_bf16")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'pin_memory' argument is set as true but no accelerator")
        summary = train_both_ways(small_demo_run, small_demo_run / "results/demo/model", out)
    return {"out": out, "summary": summary, "exports": {m: out / "exports" / m for m in ("copy", "direct")}}


def assert_identical_training(out: Path, summary: dict, steps: int = STEPS) -> None:
    copy, direct = summary["runs"]["copy"], summary["runs"]["direct"]
    print(f"train losses {copy['losses']}; validation {copy['val_losses']}")
    assert len(copy["losses"]) == steps and all(math.isfinite(x) and x > 0 for x in copy["losses"])
    assert direct["losses"] == copy["losses"]  # identical floats: the same bytes went in
    # speculators validates once per epoch: the demo's steps fit one, the image run's rows take two
    assert direct["val_losses"] == copy["val_losses"] and len(copy["val_losses"]) == copy["epochs"]
    assert summary["all_identical"] and summary["ok"] and summary["identical_steps"] == steps
    # The draft speculators saved after the run is the same too.
    a, b = (load_file(out / f"{way}/checkpoints/0/model.safetensors") for way in ("copy", "direct"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_direct_training_has_identical_losses_to_the_copy(demo):
    assert_identical_training(demo["out"], demo["summary"])


FP8_ROWS = 24  # the demo run's first rows, captured again with FP8 storage (one small shard)


def fp8_workdir(demo_run: Path, wd: Path) -> Path:
    """A finished run of the demo's first FP8_ROWS rows with extract.storage fp8_e4m3, made with the package
    functions its rules call (tokenized rows and token counts taken from the demo run)."""
    from eagle3prep.extract import extract_shard

    from testkit.shards import demo_spec

    src, res = demo_run / "results", wd / "results"
    (res / "tokenized").mkdir(parents=True)
    rows = (src / "tokenized/shard_0.jsonl").read_text().splitlines(keepends=True)[:FP8_ROWS]
    tok = res / "tokenized/shard_0.jsonl"
    tok.write_text("".join(rows))
    shutil.copy(src / "tokenized/token_freq.json", res / "tokenized/token_freq.json")
    model, shard = src / "demo/model", res / "hidden_states/shard_0"
    extract_shard(
        str(tok),
        str(shard),
        with_settings(demo_spec(model), ExtractSettings.defaults(storage="fp8_e4m3", batch_tokens=1024)),
        shard=0,
    )
    calls.validate(shard, tok, res / "validation/shard_0.json", model, reference=False)
    return wd


@pytest.fixture(scope="module")
def fp8(small_demo_run, tmp_path_factory) -> dict:
    """FP8 shards trained on both ways: from the copy export (speculators' `fp8` backend) and from the
    direct export (ours)."""
    out = tmp_path_factory.mktemp("train_fp8")
    wd = fp8_workdir(small_demo_run, out / "wd")
    exports = make_exports(wd, out / "exports")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'pin_memory' argument is set as true but no accelerator")
        summary = train_both(small_demo_run / "results/demo/model", exports, out, STEPS, RECIPE, cpu_runner())
    return {"out": out, "wd": wd, "summary": summary, "exports": exports}


def test_fp8_direct_training_has_identical_losses_to_speculators_fp8_backend(fp8):
    assert json.loads((fp8["exports"]["copy"] / "manifest.json").read_text())["hidden_states_backend"] == "fp8"
    assert_identical_training(fp8["out"], fp8["summary"])


def test_fp8_direct_rows_equal_speculators_fp8_backend_on_the_export(fp8, small_demo_run):
    """Row by row: our backend on the shards gives the very tensors speculators' fp8 backend reads from the
    FP8 copy export (the shards' bytes and per-layer scales), and both are one FP8 rounding from the bf16
    capture of the same rows."""
    from hs_connectors import FP8Transfer

    direct = Eagle3PrepBackend.from_train_args(_Args(), str(fp8["exports"]["direct"]))
    export = FP8Transfer(fp8["exports"]["copy"] / "hidden_states")
    bf16_shard = small_demo_run / "results/hidden_states/shard_0"  # the same rows captured in bf16
    truth = [load_file(bf16_shard / f"layer_{i}.safetensors")["hidden_states"] for i in DEMO_LAYER_IDS]
    offset = 0
    for row in range(FP8_ROWS):
        ours, theirs = direct.get_cached(row), export.get_cached(row)
        assert ours["hidden_states"].dtype == torch.bfloat16 and torch.equal(ours["token_ids"], theirs["token_ids"])
        assert torch.equal(ours["hidden_states"], theirs["hidden_states"])
        T = len(ours["token_ids"])
        ref = torch.stack([t[offset : offset + T] for t in truth], dim=1).float()  # [T, L, H]
        offset += T
        rel = (ours["hidden_states"].float() - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert 0 < float(rel.max()) < 0.08, (row, float(rel.max()))  # one FP8 rounding: ~0.03 per token


def test_direct_export_holds_no_hidden_state_byte_and_serves_the_same_rows(demo):
    copy, direct = demo["exports"]["copy"], demo["exports"]["direct"]
    # d2t-/t2d-{size}.npy: the vocabulary mapping speculators' trainer cached there during the run.
    on_disk = sorted(str(p.relative_to(direct)) for p in direct.rglob("*") if p.is_file() and p.suffix != ".npy")
    manifest = json.loads((direct / "manifest.json").read_text())
    assert manifest["hidden_states"] == "direct" and not (direct / "hidden_states").exists()
    assert on_disk == sorted([*manifest["files"], "manifest.json"])
    assert not [p for p in on_disk if p.endswith(".safetensors")]
    hs_bytes = sum(p.stat().st_size for p in (copy / "hidden_states").iterdir())
    direct_bytes = sum((direct / p).stat().st_size for p in on_disk)
    assert direct_bytes < hs_bytes / 20  # the arrow part and token_freq.pt only

    rows = manifest["rows"]
    transfer = Eagle3PrepBackend.from_train_args(_Args(), str(direct))
    assert isinstance(transfer, ShardTransfer)
    for i in range(rows):
        got, want = transfer.get_cached(i), load_file(copy / f"hidden_states/hs_{i}.safetensors")
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (i, k)
    assert transfer.get_cached(rows) is None  # past the end: speculators' on_missing policy decides
    with pytest.raises(RuntimeError, match="generates none"):
        transfer.get_generated({"handle": "x"})


class _Args:
    """The namespace speculators hands a backend's from_train_args (our flag left at its default): an eagle3 draft
    reading every captured auxiliary layer, the view the copy export's hs files hold."""

    eagle3prep_shards = None
    speculator_type = "eagle3"
    target_layer_ids = DEMO_LAYER_IDS[:-1]


@pytest.fixture(scope="module")
def small(tmp_path_factory, demo_model_dir) -> Path:
    return finished_results(tmp_path_factory, demo_model_dir)


def test_rows_follow_moved_shards_and_refuse_changed_ones(small, tmp_path):
    inputs = export_inputs(small)
    export_speculators(**inputs, out_dir=str(tmp_path / "direct"), hidden_states="direct")
    want = ExportRows.from_export(tmp_path / "direct").get(4)

    moved = tmp_path / "elsewhere"
    for d in inputs["shard_dirs"]:
        shutil.copytree(d, moved / Path(d).name)
    rows = ExportRows.from_export(tmp_path / "direct", shards_dir=moved)
    assert all(torch.equal(rows.get(4)[k], want[k]) for k in want)

    # A shard extracted again after the export: its rows may no longer match the arrow part.
    manifest = moved / "shard_1/manifest.json"
    manifest.write_text(manifest.read_text().replace('"rows"', '"rows" ', 1))
    with pytest.raises(ExportRowsError, match="changed since the export"):
        ExportRows.from_export(tmp_path / "direct", shards_dir=moved).get(4)
    shutil.rmtree(moved / "shard_0")
    with pytest.raises(ExportRowsError, match="shard folder shard_0 .* is in none of"):
        ExportRows.from_export(tmp_path / "direct", shards_dir=moved)
    with pytest.raises(ExportRowsError, match="must be an eagle3prep export"):
        ExportRows.from_export(tmp_path)


def test_console_script_registers_the_backend_for_speculators_parser():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["eagle3prep-train"] == "eagle3prep.train.cli:main"
    # A fresh process, as a user runs it: speculators' own --help lists our backend and its flag.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "eagle3prep.train", "--", "--help"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--eagle3prep-shards" in out.stdout and "eagle3prep" in out.stdout.split("--hidden-states-backend")[1]


@pytest.mark.integration
def test_workflow_writes_the_direct_export_and_the_backend_reads_it(tmp_path, small_demo_run):
    wd = shutil.copytree(small_demo_run, tmp_path / "wd", symlinks=True, ignore=shutil.ignore_patterns(".snakemake"))
    config = yaml.safe_load((wd / "config/config.yaml").read_text())
    config["export"] = {"speculators": True, "hidden_states": "direct"}
    (wd / "config/config.yaml").write_text(yaml.safe_dump(config))
    run = snakemake(wd)
    log = run.stdout + run.stderr
    assert "rule export:" in log and "rule extract_shard:" not in log
    out = wd / "results/export/speculators"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["hidden_states"] == "direct" and manifest["hidden_states_backend"] == "eagle3prep"
    assert (
        not (out / "hidden_states").exists()
        and "hidden states: direct" in (wd / "logs/export/speculators.log").read_text()
    )
    # The manifest names the shards relative to the workflow's folder; from elsewhere the backend finds them
    # in the workflow's layout beside the export.
    rows = ExportRows.from_export(out)
    last = manifest["rows"] - 1
    assert (
        rows.get(last)["token_ids"].tolist()
        == json.loads((wd / "results/tokenized/shard_2.jsonl").read_text().splitlines()[-1])["input_ids"]
    )


def test_train_help_shows_our_options_first_without_importing_speculators():
    """Issue #27 item 4: `eagle3prep-train --help` printed speculators' help (our options needed `--help --`)
    after ~20 s of imports. Now it prints ours at once; `-- --help` prints ours, then speculators'."""
    code = (
        "import sys; from eagle3prep.train.cli import main; rc = main(['--help']); "
        "print('IMPORTED', sorted(m for m in ('torch', 'speculators') if m in sys.modules)); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: eagle3prep-train [--metrics-jsonl FILE]")
    assert "--deterministic" in proc.stdout and "--cpu" in proc.stdout and "-- --help" in proc.stdout
    assert "IMPORTED []" in proc.stdout  # nothing of the slow imports


def guide_commands() -> dict[str, list[str]]:
    """The `eagle3prep-train` commands of docs/guides/training.md, by host ("cpu" or "gpu"), as argument
    lists without the program (shell continuations joined, comments dropped)."""
    import shlex

    guide = (REPO / "docs" / "guides" / "training.md").read_text(encoding="utf-8")
    found = {}
    for block in re.findall(r"```bash\n(.*?)```", guide, re.S):
        text = re.sub(r"#[^\n]*", "", block.replace("\\\n", " "))
        for line in text.splitlines():
            words = shlex.split(line)
            if words and words[0].split("/")[-1] == "eagle3prep-train":
                found["cpu" if "--cpu" in words else "gpu"] = words[1:]
    return found


def flags(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--")}


def test_the_guides_cpu_training_command_trains_one_epoch(small, demo_model_dir, tmp_path):
    """docs/guides/training.md's CPU command, as it stands there, run in a fresh process on a small direct
    export of the demo model: `--cpu` with `--draft-attn-impl sdpa --loss-implementation eager` trains
    an epoch and saves a draft whose config names the layer ids."""
    commands = guide_commands()
    assert {"cpu", "gpu"} <= commands.keys(), f"the guide gives no CPU and GPU eagle3prep-train command: {commands}"
    argv = commands["cpu"]
    assert {"--cpu", "--draft-attn-impl", "--loss-implementation", "--epochs"} <= flags(argv)
    # The GPU example is complete: every flag the CPU run needs, but --cpu and the CPU's loader setting.
    assert flags(argv) - {"--cpu", "--num-workers"} <= flags(commands["gpu"]), flags(argv) - flags(commands["gpu"])

    # The guide's paths, in a folder laid out as the workflow's: the demo model and a direct export.
    (tmp_path / "results/demo").mkdir(parents=True)
    (tmp_path / "results/demo/model").symlink_to(demo_model_dir)
    export_speculators(
        **export_inputs(small), out_dir=str(tmp_path / "results/export/speculators"), hidden_states="direct"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3prep.train", *argv],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    save = tmp_path / argv[argv.index("--save-path") + 1]
    metrics = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train"]["loss"] for m in metrics if "train" in m]
    assert losses and all(math.isfinite(x) and x > 0 for x in losses), metrics
    assert any("val" in m for m in metrics)  # the epoch ended with speculators' validation pass
    draft = json.loads((save / "0/config.json").read_text())  # one folder per epoch
    assert draft["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
