"""`snakemake --report report.zip` on the demo: the final outputs, with their captions and categories."""

import json
import re
import shutil
import zipfile

import pytest
import yaml

from testkit.workflow import snakemake

pytestmark = pytest.mark.integration


def _js_var(html: str, name: str):
    """The JSON literal the report's page assigns to `var <name>`."""
    m = re.search(rf'^\s*var {name} = ([{{\["].*);\s*$', html, re.M)
    assert m, f"report.html has no `var {name}`"
    return json.loads(m.group(1))


def test_report_zip_holds_outputs_with_captions_and_categories(small_demo_run, tmp_path):
    wd = small_demo_run
    snakemake(wd, "--report", str(tmp_path / "report.zip"))
    with zipfile.ZipFile(tmp_path / "report.zip") as z:
        names = z.namelist()
        page = z.read("report/report.html").decode()
        raw = {n.rsplit("/", 1)[1]: z.read(n) for n in names if n.startswith("report/data/raw/")}

    assert sorted(raw) == sorted(
        ["report.html", "summary.csv", "dataset_manifest.json"] + [f"shard_{k}.json" for k in range(3)]
    )
    assert raw["report.html"] == (wd / "results/report/report.html").read_bytes()
    assert raw["shard_1.json"] == (wd / "results/validation/shard_1.json").read_bytes()

    assert _js_var(page, "categories") == {
        "Report": {"Other": ["results/report/report.html"]},
        "Dataset": {"Other": ["results/report/dataset_manifest.json", "results/report/summary.csv"]},
        "Validation": {"Other": [f"results/validation/shard_{k}.json" for k in range(3)]},
    }
    results = _js_var(page, "results")
    # Captions are the report/*.rst sentences, rendered with the job's wildcards.
    assert "shard 2: manifest and file checksums" in results["results/validation/shard_2.json"]["caption"]
    assert results["results/validation/shard_2.json"]["labels"] == {"shard": "2"}
    assert "worst reference error against its bound" in results["results/report/report.html"]["caption"]
    assert "sha256 of its manifest" in results["results/report/dataset_manifest.json"]["caption"]
    assert "tokens per second" in results["results/report/summary.csv"]["caption"]
    # The workflow description (report/workflow.rst) is rendered with the run's config.
    assert "into 3 tokenized shards" in _js_var(page, "workflow_desc")


def _dry_run_after_edit(wd, section: str, key: str, value) -> str:
    config = yaml.safe_load((wd / "config/config.yaml").read_text())
    config.setdefault(section, {})[key] = value
    (wd / "config/config.yaml").write_text(yaml.safe_dump(config))
    return snakemake(wd, "-n").stdout


def test_config_edits_that_do_not_decide_the_data_leave_the_report_alone(small_demo_run, tmp_path):
    # A copy with .snakemake: its records of each job's params are what a params edit is checked against.
    wd = shutil.copytree(small_demo_run, tmp_path / "wd", symlinks=True)
    out = _dry_run_after_edit(wd, "plan", "engine_start_s", 5)
    assert "rule report:" not in out and "Nothing to be done" in out
    out = _dry_run_after_edit(wd, "extract", "batch_tokens", 512)  # a speed knob
    assert "rule report:" not in out
    out = _dry_run_after_edit(wd, "validate", "seed", 7)  # decides the validation files: the report follows
    assert "rule validate:" in out and "rule report:" in out
    reason = out[out.index("rule report:") :].split("\n\n")[0]
    assert "Params have changed" not in reason  # the reason names the new validations, not a config dump
