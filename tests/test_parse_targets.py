"""A target typed after --configfile is read by Snakemake as one more config file: every target the guides name has
a marker file at the repository root, and a workflow output read as a config is named (run.parse)."""

import subprocess

import pytest
import yaml

from eagle3prep.config import ConfigError
from eagle3prep.run.parse import check_target_marker

from testkit.workflow import REPO, SMALL_CONFIG, SNAKEMAKE, make_workdir

TARGETS = ("plan", "verify", "overfit_gate", "regenerate_review", "all")


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_the_guides_name_stops_in_one_line_after_configfile(tmp_path, target):
    marker = yaml.safe_load((REPO / target).read_text())
    with pytest.raises(ConfigError) as e:
        check_target_marker(marker, [str(tmp_path / "my.yaml"), str(REPO / target)], tmp_path)
    assert str(e.value).endswith(f"put the target first: snakemake {target} --configfile my.yaml")


def test_a_workflow_output_after_configfile_is_named_not_read_as_a_config(tmp_path):
    files = [str(tmp_path / "my.yaml"), str(tmp_path / ".eagle3prep/plan/plan.json")]
    with pytest.raises(ConfigError) as e:
        check_target_marker({"shards": []}, files, tmp_path)
    assert str(e.value) == (
        "config error: `.eagle3prep/plan/plan.json` after --configfile was read as a config file (--configfile takes "
        "several), but it is one of the workflow's outputs; put the target first: snakemake .eagle3prep/plan/plan.json "
        "--configfile my.yaml"
    )
    check_target_marker({}, [str(tmp_path / "results.yaml")], tmp_path)  # a config of that name is no output


def test_verify_after_configfile_in_the_repository_is_one_line_not_a_traceback(tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text(yaml.safe_dump(SMALL_CONFIG))
    wd = make_workdir(tmp_path / "wd")
    cmd = [SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"), "--directory", str(wd), "--configfile", str(config)]
    proc = subprocess.run([*cmd, "verify", "-n"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"put the target first: snakemake verify --configfile {config}" in proc.stderr


def test_any_other_target_after_configfile_runs_when_the_files_end_with_a_double_dash(tmp_path):
    """A target the workflow cannot catch (Snakemake reads it as a config file before the Snakefile runs: a folder
    such as report/, a shard path) has the one-line workaround reruns.md gives: `--` after the config files."""
    config = tmp_path / "my.yaml"
    config.write_text(yaml.safe_dump(SMALL_CONFIG))
    wd = make_workdir(tmp_path / "wd")
    cmd = [SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"), "-n", "--configfile", str(config)]
    proc = subprocess.run([*cmd, "--", "results/tokenized"], cwd=wd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rule tokenize:" in proc.stdout and "rule extract:" not in proc.stdout
    guide = (REPO / "docs/guides/reruns.md").read_text()
    assert (
        "end the config files with `--`:\n`snakemake --configfile my.yaml -- results/hidden_states/shard_3`" in guide
    )
