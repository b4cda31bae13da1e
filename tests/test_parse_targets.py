"""A target typed after --configfile is read by Snakemake as one more config file: without a file of that name
Snakemake stops before the Snakefile runs, naming the file; a file the workflow can see (one of its outputs, or a
file named like a target the guides name) is named in one line (run.parse)."""

import subprocess

import pytest
import yaml

from eagle3prep.config import ConfigError
from eagle3prep.run.parse import TARGETS, check_targets_after_configfile

from testkit.workflow import REPO, SMALL_CONFIG, SNAKEMAKE, make_workdir


@pytest.mark.parametrize("target", TARGETS)
def test_a_file_named_like_a_target_after_configfile_stops_in_one_line(tmp_path, target):
    with pytest.raises(ConfigError) as e:
        check_targets_after_configfile([str(tmp_path / "my.yaml"), str(tmp_path / target)], tmp_path)
    assert str(e.value).endswith(f"put the target first: snakemake {target} --configfile my.yaml")


def test_a_workflow_output_after_configfile_is_named_not_read_as_a_config(tmp_path):
    files = [str(tmp_path / "my.yaml"), str(tmp_path / ".eagle3prep/plan/plan.json")]
    with pytest.raises(ConfigError) as e:
        check_targets_after_configfile(files, tmp_path)
    assert str(e.value) == (
        "config error: `.eagle3prep/plan/plan.json` after --configfile was read as a config file (--configfile takes "
        "several), but it is one of the workflow's outputs; put the target first: snakemake .eagle3prep/plan/plan.json "
        "--configfile my.yaml"
    )
    check_targets_after_configfile([str(tmp_path / "results.yaml")], tmp_path)  # a config of that name is no output
    check_targets_after_configfile([str(tmp_path / "a.yaml"), str(tmp_path / "sub/plan")], tmp_path)  # elsewhere


def test_the_repository_root_holds_no_file_named_like_a_target():
    """Snakemake reads a target typed after --configfile as a config file; the guides teach targets first."""
    assert not [t for t in TARGETS if (REPO / t).exists()]


def test_verify_after_configfile_names_the_file_snakemake_could_not_read(tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text(yaml.safe_dump(SMALL_CONFIG))
    wd = make_workdir(tmp_path / "wd")
    cmd = [SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"), "--directory", str(wd), "--configfile", str(config)]
    proc = subprocess.run([*cmd, "verify", "-n"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "No such file or directory: 'verify'" in proc.stdout + proc.stderr


def test_any_other_target_after_configfile_runs_when_the_files_end_with_a_double_dash(tmp_path):
    """A target typed after the config files is read as one: `--` after them ends the list (reruns.md)."""
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
