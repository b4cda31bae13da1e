"""The whole demo workflow through the snakemake CLI: dry run, lint, a full run, and kill-and-rerun."""

import csv
import json
import re
import signal

import pytest
import yaml

from testkit.workflow import (
    REPO,
    SMALL_CONFIG,
    SMALL_CONFIG_JOBS,
    SNAKEMAKE,
    make_workdir,
    snakemake,
    stat_files,
    tree_digest,
    vllm_stand_in,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def full_run(small_demo_run):
    """One uninterrupted run of the small demo config (shared with other test modules)."""
    return small_demo_run


def test_dry_run_lists_every_job_before_anything_runs(tmp_path):
    wd = make_workdir(tmp_path)
    out = snakemake(wd, "-n").stdout
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", out, re.M))
    assert counts == SMALL_CONFIG_JOBS
    for k in range(3):
        assert f"results/hidden_states/shard_{k}" in out
    assert not (wd / "results").exists()


def test_gpu_resources_are_declared_under_both_names(tmp_path):
    wd = make_workdir(tmp_path, {**SMALL_CONFIG, "extract": {"backend": "vllm"}})
    out = snakemake(wd, "-n", "--resources", "gpus=8", env=vllm_stand_in(tmp_path)).stdout
    assert re.search(r"resources: .*gpus=1.*gpu=1|resources: .*gpu=1.*gpus=1", out)


def test_config_error_is_one_line_naming_key_and_allowed_values(tmp_path):
    wd = make_workdir(tmp_path, {**SMALL_CONFIG, "extract": {"backend": "torchscript"}})
    proc = snakemake(wd, "-n", check=False)
    assert proc.returncode != 0
    assert "config error: extract.backend = 'torchscript' is not allowed; choose one of ['hf', 'vllm']" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_lint_and_format_are_clean():
    import subprocess

    lint = snakemake(REPO, "--lint", "-n")
    assert "Congratulations, your workflow is in a good condition!" in lint.stdout + lint.stderr
    bindir = REPO / ".venv" / "bin" if (REPO / ".venv/bin/snakefmt").exists() else None
    tool = (lambda name: str(bindir / name)) if bindir else (lambda name: SNAKEMAKE.replace("snakemake", name))
    fmt = subprocess.run([tool("snakefmt"), "--check", "Snakefile", "rules"], cwd=REPO, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stderr
    ruff = subprocess.run([tool("ruff"), "check", "."], cwd=REPO, capture_output=True, text=True)
    assert ruff.returncode == 0, ruff.stdout


def test_full_run_outputs(full_run):
    wd = full_run
    counts = json.loads((wd / "results/prepared/counts.json").read_text())["totals"]
    q = sum(counts["quarantined"].values())
    assert counts["rows_in"] == counts["kept"] + counts["duplicates"] + q and q > 0
    stats = json.loads((wd / "results/tokenized/stats.json").read_text())
    rows = [
        json.loads(line)
        for k in range(3)
        for line in (wd / f"results/tokenized/shard_{k}.jsonl").read_text().splitlines()
    ]
    assert [r["row"] for r in rows] == list(range(len(rows))) == list(range(stats["rows"]))
    for k in range(3):
        v = json.loads((wd / f"results/validation/shard_{k}.json").read_text())
        assert v["ok"] and v["reference"] and all(c["ok"] for c in v["checks"])
        assert {c["check"] for c in v["checks"]} >= {"token_ids", "tokenized_source", "row_count", "reference:layer_8"}
    manifest = json.loads((wd / "results/report/dataset_manifest.json").read_text())
    assert manifest["layer_ids"] == [2, 4, 5, 8] and manifest["layer_id_convention"] == "input_of_layer"
    assert manifest["rows"] == len(rows) and len(manifest["shards"]) == 3
    summary = list(csv.DictReader((wd / "results/report/summary.csv").read_text().splitlines()))
    assert [int(r["rows"]) for r in summary] == [s["rows"] for s in manifest["shards"]]
    html = (wd / "results/report/report.html").read_text()
    assert html.count("<img") >= 5 and "Hidden-state statistics per layer and shard" in html
    assert "Draft-vocabulary coverage" in html and "Validation: every check per shard" in html
    assert "tok/s" in (wd / "logs/extract/shard_0.log").read_text()
    assert not list((wd / "results").rglob(".tmp-*")), "temp files left behind after a successful run"


def test_speed_knobs_requeue_no_finished_shard_but_data_keys_do(tmp_path, full_run):
    """After an out-of-memory crash a user lowers gpu_memory_utilization or batch_tokens and reruns:
    the finished shards stay finished. A key that changes the data (dtype) re-queues every shard."""

    def dry_run(extract: dict) -> str:
        override = tmp_path / "override.yaml"  # merged over config/config.yaml, named first (issue #27 item 2)
        # replace_results: a content key (dtype) is refused on finished shards without it (test_made_by.py)
        override.write_text(
            yaml.safe_dump({"extract": {**SMALL_CONFIG["extract"], **extract}, "replace_results": True})
        )
        return snakemake(full_run, "-n", "--configfile", "config/config.yaml", str(override)).stdout

    speed = {"batch_tokens": 512, "threads": 2, "gpu_memory_utilization": 0.5, "max_num_batched_tokens": 4096}
    assert "rule extract:" not in dry_run(speed)
    out = dry_run({"dtype": "float32"})
    assert re.search(r"^extract\s+3$", out, re.M), out
    assert "Params have changed since last execution" in out


def test_chat_template_kwargs_requeue_tokenize_and_their_default_adds_no_param(full_run):
    """tokenize.chat_template_kwargs changes the rendered text, as a template edit would: set, it re-queues
    tokenize and what follows. At its default {} the rule has the params it had before the key existed."""
    assert "Nothing to be done" in snakemake(full_run, "-n").stdout
    kwargs = "tokenize={chat_template_kwargs: {enable_thinking: false}}"
    out = snakemake(full_run, "-n", "--config", kwargs, "replace_results=true").stdout  # refused without it
    assert re.search(r"^tokenize\s+1$", out, re.M) and re.search(r"^extract\s+3$", out, re.M), out
    assert "Params have changed since last execution" in out
    bad = snakemake(full_run, "-n", "--config", "tokenize={chat_template_kwargs: {eos_token: x}}", check=False)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "config error: tokenize.chat_template_kwargs.eos_token: the encoder passes eos_token" in bad.stderr


def test_sigkill_during_extract_then_rerun_resumes_at_shard_granularity(tmp_path, full_run):
    # Shard 0 finished, shards 1 and 2 not yet extracted: the uninterrupted run's folder (results/, logs/ and
    # .snakemake/ with their mtimes) without what a run stopped after shard 0 would not have made yet. (It was
    # a run of its own up to shard 0: the demo model, prepare and tokenize again, a second time per session.)
    import shutil

    wd = shutil.copytree(full_run, tmp_path / "run", symlinks=True)
    for k in (1, 2):
        shutil.rmtree(wd / f"results/hidden_states/shard_{k}")
        (wd / f"results/validation/shard_{k}.json").unlink()
    shutil.rmtree(wd / "results/report")
    # Then the run is SIGKILLed (whole process group) inside another shard.
    before = stat_files(wd / "results/hidden_states/shard_0")
    killed = snakemake(
        wd,
        "--cores",
        "1",
        env={"EAGLE3PREP_KILL_AT": "extract.between_batches:batch=1"},
        check=False,
        new_session=True,
    )
    assert killed.returncode == -signal.SIGKILL
    unfinished = [k for k in (1, 2) if not (wd / f"results/hidden_states/shard_{k}/manifest.json").exists()]
    assert unfinished, "the kill point was not reached"
    # The same command again: it resumes, and the finished shard is neither recomputed nor touched.
    rerun = snakemake(wd)
    assert "removed stale lock" in rerun.stderr
    assert stat_files(wd / "results/hidden_states/shard_0") == before
    assert "shard_0" not in re.findall(r"output: (results/hidden_states/shard_\d+)", rerun.stdout + rerun.stderr)
    assert tree_digest(wd / "results") == tree_digest(full_run / "results")


def test_example_configs_dry_run(tmp_path, demo_model_dir):
    """config/examples/*.yaml: valid, and the Kimi-K2.5 GPU jobs take the whole node (TP 8)."""
    import shutil

    import yaml

    # A multimodal wrapper keeps the language model's facts in text_config, as Kimi-K2.5's config.json does.
    facts = {
        "kimi-k2.5-int4.yaml": {
            "model_type": "kimi_k25",
            "text_config": {"num_hidden_layers": 61, "hidden_size": 64},
            "vision_config": {},
        },
        "llama-3.1-8b.yaml": {"num_hidden_layers": 32, "hidden_size": 64},
    }
    for name, gpus in (("kimi-k2.5-int4.yaml", 8), ("llama-3.1-8b.yaml", 1)):
        cfg = yaml.safe_load((REPO / "config/examples" / name).read_text())
        wd = make_workdir(tmp_path / name, cfg)
        # The example's data and model paths do not exist here: stand-ins at the same relative places.
        (wd / "data").mkdir()
        cfg["data"]["sources"] = [str(wd / "data/conversations.jsonl")]
        (wd / "data/conversations.jsonl").write_text("")
        cfg["model"]["path"] = str(wd / "model")
        (wd / "model").mkdir()  # the layer ids and max_seq_len are checked against its config.json
        (wd / "model/config.json").write_text(json.dumps(facts[name]))
        (wd / "model/model.safetensors").write_bytes(b"")  # the parse asks for weight files, not their contents
        for f in demo_model_dir.iterdir():  # the parse loads the tokenizer as tokenize would: the demo's stands in
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, wd / "model" / f.name)
        (wd / "config/config.yaml").write_text(yaml.safe_dump(cfg))
        run = snakemake(wd, "-n", "--resources", f"gpu={gpus}", env=vllm_stand_in(tmp_path))
        out = run.stdout
        # Kimi-K2.5's vision tower: the parse says, in one line, that its image conversations would be quarantined.
        kimi_note = "tokenizing images for model_type 'kimi_k25' is not implemented"
        assert (kimi_note in run.stdout + run.stderr) == (name == "kimi-k2.5-int4.yaml"), run.stderr[-2000:]
        assert re.search(rf"rule extract:.*?resources: [^\n]*gpus={gpus}, gpu={gpus}", out, re.S), out
        shards = cfg["tokenize"]["num_shards"]
        assert re.search(rf"^extract\s+{shards}$", out, re.M)


def test_the_same_command_heals_deleted_damaged_interrupted_and_failed_shards(tmp_path, full_run):
    """A deleted shard, a damaged one and a Ctrl-C: each is named in one line, and the same command ends
    with every shard byte-identical to an uninterrupted run; the shard that failed validation is kept
    in results/failed/ for study. (Before: "Nothing to be done" with shard_2 gone.)"""
    import os
    import shutil
    import subprocess

    wd = tmp_path / "run"
    shutil.copytree(full_run, wd, symlinks=True)
    shutil.rmtree(wd / "results/hidden_states/shard_2")
    layer = wd / "results/hidden_states/shard_1/layer_2.safetensors"
    data = bytearray(layer.read_bytes())
    data[-8] ^= 0xFF  # damaged in place: only validation can tell
    layer.write_bytes(data)
    (wd / "results/validation/shard_1.json").unlink()

    dry = snakemake(wd, "-n")
    assert (
        "eagle3prep: results/hidden_states/shard_2 is missing but results/validation/shard_2.json exists: "
        "extracting it again" in dry.stderr
    )
    assert (
        "eagle3prep: results/validation/shard_1.json is missing but results/report/dataset_manifest.json" in dry.stderr
    )
    assert re.search(r"^extract\s+1$", dry.stdout, re.M), dry.stdout

    # Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while shard_2 is being extracted:
    # sent by the job itself after its first batch (faults.py), where a timed signal could miss a fast job.
    cmd = [SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"), "--cores", "1"]
    env = {**os.environ, "EAGLE3PREP_KILL_AT": "extract.between_batches:shard=2,batch=0",
           "EAGLE3PREP_KILL_SCOPE": "interrupt"}  # fmt: skip
    log = wd / "logs/extract/shard_2.log"
    log.unlink()  # the copied run's
    # SIGINT at its default, as under a terminal: a shell without job control (a background `cmd &` in a script)
    # starts its children with SIGINT ignored, and then neither Snakemake nor the job would see this Ctrl-C.
    proc = subprocess.Popen(cmd, cwd=wd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0 and "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    # The job prints its line into its log; Snakemake echoes a failed job's log only when it is still
    # running by the time the job has written it (under load it may exit first), so read the log too.
    job_log = log.read_text() if log.exists() else ""
    line = "interrupted (Ctrl-C): this job's outputs are incomplete; the same command redoes it"
    assert line in out or line in job_log, (out[-2000:], job_log[-2000:])
    assert "Traceback" not in job_log, job_log[-3000:]

    # The same command, until it succeeds: shard_1 fails validation once, then is set aside and redone.
    for _ in range(3):
        rerun = snakemake(wd, check=False)
        if rerun.returncode == 0:
            break
        assert "1 check(s) failed: file:layer_2.safetensors" in rerun.stderr, rerun.stderr[-3000:]
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    failed = wd / "results/failed/shard_1"
    assert "[validate] FAIL file:layer_2.safetensors" in (failed / "validate.log").read_text()
    assert (failed / "hidden_states/layer_2.safetensors").read_bytes() == bytes(data)
    digest = tree_digest(wd / "results")
    assert {p: h for p, h in digest.items() if not p.startswith("failed/")} == tree_digest(full_run / "results")
    assert "Nothing to be done" in snakemake(wd, "-n").stdout


def test_a_deleted_layer_file_and_what_verify_finds_are_healed_by_one_run_of_the_same_command(tmp_path, full_run):
    """Before: a deleted layer file took two reruns (the first failed validation: "listed in the manifest but
    missing"), and a file damaged in place that verify found was never redone by the same command."""
    import shutil

    wd = shutil.copytree(full_run, tmp_path / "run", symlinks=True)
    damaged = wd / "results/hidden_states/shard_1/layer_5.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-8] ^= 0xFF  # in place: same name, same size, the folder's date unchanged
    damaged.write_bytes(data)
    bad = snakemake(wd, "verify", check=False)
    assert bad.returncode != 0 and "the next run of the same command makes them again: " in bad.stderr
    (wd / "results/hidden_states/shard_0/layer_2.safetensors").unlink()  # after verify: the listing tells
    rerun = snakemake(wd, check=False)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (
        "eagle3prep: results/hidden_states/shard_0: layer_2.safetensors is listed in its manifest.json but missing: "
        "extracting it again" in rerun.stderr
    )
    assert "eagle3prep: results/hidden_states/shard_1: shard_1/layer_5.safetensors: sha256 " in rerun.stderr
    assert "verify: ok: " in snakemake(wd, "verify").stderr
    assert tree_digest(wd / "results") == {
        p: h for p, h in tree_digest(full_run / "results").items() if p != "verify.json"
    } | {"verify.json": tree_digest(wd / "results")["verify.json"]}
