"""The regenerate stage in the workflow, without an engine: the DAG with the stage off (as it was) and on (the new
jobs, their GPUs), lint with it on, and prompt-only data reaching the prompt shards. The stage's vLLM jobs run in
tests/test_vllm_regenerate.py."""

import json
import re

import pytest

from testkit.workflow import REPO, SMALL_CONFIG, SMALL_CONFIG_JOBS, make_workdir, snakemake, vllm_stand_in

pytestmark = pytest.mark.integration

# Without the stage, `snakemake -n` lists what it listed before the stage existed.
JOBS_OFF = SMALL_CONFIG_JOBS
PROMPTS = "results/regenerate/prompts"


def jobs(out: str) -> dict[str, str]:
    return dict(re.findall(r"^(\w+)\s+(\d+)$", out, re.M))


def test_off_the_dag_is_as_it_was_and_on_it_holds_the_stage(tmp_path):
    wd = make_workdir(tmp_path)
    off = snakemake(wd, "-n").stdout
    assert jobs(off) == JOBS_OFF and "regenerat" not in off
    assert "input: results/prepared/conversations.jsonl, results/prepared/counts.json" in off  # tokenize's
    explicit_off = snakemake(wd, "-n", "--config", "regenerate={enabled: false, num_shards: 5}").stdout
    assert jobs(explicit_off) == JOBS_OFF

    # The stage's jobs need vLLM, which this Python may lack (the run would stop in one line): an empty module
    # stands in for it, since only the DAG is asked for here.
    on = snakemake(
        wd, "-n", "--config", "regenerate={enabled: true, num_shards: 3, tp_size: 2}", env=vllm_stand_in(tmp_path)
    ).stdout
    assert jobs(on) == {
        **{k: v for k, v in JOBS_OFF.items() if k != "prepare"},
        "prepare_prompt_only": "1",
        "regenerate_split": "1",
        "regenerate": "3",
        "regenerate_merge": "1",
        "total": "16",
    }
    for k in range(3):
        assert f"output: results/regenerate/shard_{k}" in on
    regen_jobs = re.findall(r"rule regenerate:\n(?:    .*\n)+", on)
    assert len(regen_jobs) == 3 and all(re.search(r"resources: .*gpus=2.*gpu=2", j) for j in regen_jobs)
    assert "input: results/regenerated/conversations.jsonl, results/regenerated/counts.json" in on  # tokenize's
    assert not (wd / "results").exists()


def test_lint_is_clean_with_the_stage_on():
    lint = snakemake(REPO, "--lint", "-n", "--config", "regenerate={enabled: true, num_shards: 2}")
    assert "Congratulations, your workflow is in a good condition!" in lint.stdout + lint.stderr


def test_a_bad_regenerate_value_is_one_line(tmp_path):
    wd = make_workdir(tmp_path)
    proc = snakemake(wd, "-n", "--config", "regenerate={enabled: true, turns: first}", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "config error: regenerate.turns = 'first' is not allowed; choose one of ['all', 'last']" in proc.stderr


def test_prompt_only_records_reach_the_prompt_shards_only_with_the_stage_on(tmp_path):
    """Without the stage a record with no assistant turn is quarantined as today; with it, prepare keeps it and the
    split puts it in a prompt shard (up to the GPU jobs, which need vLLM)."""
    records = [
        {"messages": [{"role": "user", "content": "Only a question?"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Another one?"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
    ]
    # Without the stage 2 of the 3 rows are lost, over the default data.max_quarantine_share: allowed here.
    config = {**SMALL_CONFIG, "data": {"sources": ["prompts.jsonl"], "max_quarantine_share": 1}}

    def run(sub: str, *args: str):
        wd = make_workdir(tmp_path / sub, config)
        (wd / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        snakemake(wd, *args)
        return wd

    off = run("off", "results/prepared/counts.json")
    totals = json.loads((off / "results/prepared/counts.json").read_text())["totals"]
    assert (totals["kept"], totals["quarantined"]["no_assistant_turn"]) == (1, 2)

    on = run("on", PROMPTS, "--config", "regenerate={enabled: true, num_shards: 2}")
    split = json.loads((on / PROMPTS / "split.json").read_text())
    assert [s["rows"] for s in split["shards"]] == [2, 1] and split["rows"] == 3
    shard0 = [json.loads(line) for line in (on / PROMPTS / "shard_0.jsonl").read_text().splitlines()]
    assert [c["messages"][-1]["content"] for c in shard0] == ["Only a question?", "Another one?"]
