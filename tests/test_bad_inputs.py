"""The bad-input corpus (tests/data/bad/cases.yaml): each case ends in a quarantine record with a reason or
in one line that names the file, line or config key. Most cases run the package directly (fast); a few go
through the `snakemake` CLI to show what the user actually sees.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from eagle3prep.backends.base import CaptureSpec
from eagle3prep.config import validate_config
from eagle3prep.errors import UserError
from eagle3prep.prepare import expand_sources, prepare
from eagle3prep.run.parse import check_model, check_tokenizer, config_sources
from eagle3prep.settings import Settings
from eagle3prep.tokenize import tokenize_conversations

from testkit.workflow import REPO, make_workdir, snakemake

BAD = Path(__file__).parent / "data" / "bad"
CASES = yaml.safe_load((BAD / "cases.yaml").read_text(encoding="utf-8"))
SOURCE_CASES = [c for c in CASES if c["kind"] == "source"]
CONFIG_CASES = [c for c in CASES if c["kind"] == "config"]
GOOD_SOURCE = str(REPO / "resources" / "demo" / "sharegpt.jsonl")
HUGE_LINE = ('{"messages": [{"role": "user", "content": "', 20 * 2**20, '"}]}')  # 20 MiB: over the 16 MiB default


def case_id(case: dict) -> str:
    if case["kind"] == "source":
        return case["file"]
    return f"{case['at']}:{json.dumps(case.get('config', {}), separators=(',', ':'))}{case.get('model', '')}"


def merged(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def assert_one_line(message: str, *parts: str) -> None:
    assert "\n" not in message.strip(), f"not one line: {message!r}"
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


# ------------------------------------------------------------------------------------------ sources


def good_line(i: int) -> str:
    return json.dumps(
        {"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": f"A{i}."}]}
    )


def place(case: dict, folder: Path) -> str:
    """Put the case's source into `folder` (the cwd); return the path as the config would list it."""
    name, make = case["file"], case.get("make")
    target = folder / name
    if make == "huge_line":
        with open(target, "w", encoding="utf-8") as f:
            f.write(good_line(1) + "\n")
            f.write(HUGE_LINE[0] + "x" * HUGE_LINE[1] + HUGE_LINE[2] + "\n")
            f.write(good_line(3) + "\n")
    elif make == "directory":
        target.mkdir()
    elif make == "fifo":
        os.mkfifo(target)
    elif make == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads a chmod 000 file anyway; the fifo and directory cases cover unreadable sources")
        target.write_text(good_line(1) + "\n")
        target.chmod(0)
    elif make is not None:
        raise ValueError(f"unknown make: {make}")
    elif (BAD / "sources" / name).is_dir():
        shutil.copytree(BAD / "sources" / name, target)
    elif (BAD / "sources" / name).exists():
        shutil.copy(BAD / "sources" / name, target)
    return name


def run_prepare(sources: list[str], out: Path, **kw) -> tuple[dict, list[dict], list[dict]]:
    kw = {"max_line_bytes": 1 << 24, "allow_no_user_turn": False, **kw}
    counts = prepare(sources, out / "conversations.jsonl", out / "quarantine.jsonl", out / "counts.json", **kw)
    conversations = [json.loads(line) for line in (out / "conversations.jsonl").read_text("utf-8").splitlines()]
    quarantine = [json.loads(line) for line in (out / "quarantine.jsonl").read_text("utf-8").splitlines()]
    t = counts["totals"]
    assert t["rows_in"] == t["kept"] + t["duplicates"] + t["quarantined_total"], "rows in != out + dropped"
    assert (len(conversations), len(quarantine)) == (t["kept"], t["quarantined_total"])
    return counts, conversations, quarantine


def unblock_fifo_later(path: Path) -> threading.Timer:
    """Should a reader ever block on the FIFO, give it EOF after 20 s, so the test fails instead of hanging."""

    def unblock() -> None:
        with contextlib.suppress(OSError):  # no reader: nothing was blocked
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    timer = threading.Timer(20, unblock)
    timer.start()
    return timer


@pytest.mark.parametrize("case", SOURCE_CASES, ids=case_id)
def test_source_case(case, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    name = place(case, tmp_path)
    expect = case["expect"]
    out = tmp_path / "out"
    kw = {"max_line_bytes": case["max_line_bytes"]} if "max_line_bytes" in case else {}

    if "error" in expect:
        timer = unblock_fifo_later(tmp_path / name) if case.get("make") == "fifo" else None
        try:
            with pytest.raises(UserError) as e:
                run_prepare(expand_sources([name]), out, **kw)  # as common.smk, then the prepare job
        finally:
            if timer:
                timer.cancel()
        assert_one_line(str(e.value), name, expect["error"])
        assert not out.exists() or not any(out.iterdir()), "a refused source left outputs behind"
        return

    counts, conversations, quarantine = run_prepare([name], out, **kw)
    t = counts["totals"]
    if "quarantine" in expect:  # the bad record is line 2 between two good ones, unless said otherwise
        expect = {"rows_in": 3, "kept": 2, **expect}
        hits = [q for q in quarantine if (q["reason"], q["line"]) == (expect["quarantine"], expect["line"])]
        assert hits, f"no {expect['quarantine']} at line {expect['line']} in {quarantine}"
        assert hits[0]["file"] == name and expect.get("detail", "") in hits[0]["detail"], hits[0]
        assert {q["reason"] for q in quarantine} == {expect["quarantine"]}
    for key in ("rows_in", "kept", "duplicates"):
        if key in expect:
            assert t[key] == expect[key], (key, t)
    assert all(c["source"].startswith(f"{name}:") for c in conversations)

    if case.get("stage") == "tokenize":
        model = request.getfixturevalue("demo_model_dir")
        tok = tmp_path / "tokenized"
        stats = tokenize_conversations(
            out / "conversations.jsonl", model, [tok / "shard_0.jsonl"], tok / "stats.json", tok / "freq.json",
            tok / "quarantine.jsonl", max_seq_len=case["max_seq_len"], template_fallback=True, trust_remote_code=False, workers=2, chat_template_kwargs={},
        )  # fmt: skip
        assert stats["conversations_in"] == stats["rows"] + stats["quarantined_total"] == t["kept"]
        assert stats["truncated_rows"] == expect.get("truncated", 0)
        reason = expect.get("tokenize_quarantine")
        assert stats["quarantined"] == ({reason: 1} if reason else {})
        assert stats["seq_len"]["max"] <= case["max_seq_len"]


def test_huge_line_is_skipped_in_bounded_memory(tmp_path, monkeypatch):
    """The 20 MiB line is read in 1 MiB pieces; only its first 1 KiB lands in the quarantine record."""
    monkeypatch.chdir(tmp_path)
    name = place({"file": "huge.jsonl", "make": "huge_line"}, tmp_path)
    _, conversations, quarantine = run_prepare([name], tmp_path / "out")
    assert len(conversations) == 2 and len(quarantine) == 1
    assert (
        len(quarantine[0]["record"]) <= 1024
        and f"line is {len(HUGE_LINE[0]) + HUGE_LINE[1] + len(HUGE_LINE[2])} bytes" in quarantine[0]["detail"]
    )


def test_whole_corpus_in_one_run_counts_every_row(tmp_path, monkeypatch):
    """Every readable bad file as the sources of one prepare run: rows in = kept + duplicates + quarantined."""
    monkeypatch.chdir(tmp_path)
    readable = [
        c for c in SOURCE_CASES if "error" not in c["expect"] and "make" not in c and "max_line_bytes" not in c
    ]
    names = [place(c, tmp_path) for c in readable]
    counts, _, quarantine = run_prepare(names, tmp_path / "out")
    per_reason: dict[str, int] = {}
    for c in readable:
        if "quarantine" in c["expect"]:
            n = c["expect"].get("rows_in", 3) - c["expect"].get("kept", 2)
            per_reason[c["expect"]["quarantine"]] = per_reason.get(c["expect"]["quarantine"], 0) + n
    assert {r: n for r, n in counts["totals"]["quarantined"].items() if n} == per_reason
    assert [f["file"] for f in counts["files"]] == names
    assert {q["file"] for q in quarantine} <= set(names)


# ------------------------------------------------------------------------------------------- config


@pytest.fixture(scope="module")
def model_variants(demo_model_dir, tmp_path_factory) -> dict[str, Path]:
    """The demo model, and copies whose tokenizer has no chat template / no generation markers / no files."""
    root = tmp_path_factory.mktemp("model_variants")
    variants = {"demo": demo_model_dir}
    for variant in ("no_chat_template", "no_generation_markers", "no_tokenizer"):
        folder = shutil.copytree(demo_model_dir, root / variant)
        template = folder / "chat_template.jinja"
        if variant == "no_tokenizer":
            for f in folder.glob("tokenizer*"):
                f.unlink()
        elif variant == "no_chat_template":
            template.unlink()
        else:
            template.write_text(
                template.read_text().replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
            )
        variants[variant] = folder
    return variants


def check_config(case: dict, tmp_path: Path, request) -> None:
    """What rules/common.smk checks at parse time, in its order: the schema, the sources, what the model folder's
    config.json decides, then its tokenizer (as the tokenize job loads it); the extract job's spec last."""
    model = str(request.getfixturevalue("model_variants")[case.get("model", "demo")])
    base = {"data": {"sources": [GOOD_SOURCE]}, "model": {"path": model}, "tokenize": {"max_seq_len": 128}}
    settings = Settings.validated(merged(base, case.get("config", {})))
    config_sources(settings)
    check_model(settings)
    check_tokenizer(settings, stamp=None)
    CaptureSpec(  # what the extract job builds from the settings (the layer ids need the model folder)
        settings.extract, model, settings.layer_ids(), settings.tokenize.max_seq_len, settings.model.trust_remote_code
    )


@pytest.mark.parametrize("case", [c for c in CONFIG_CASES if c["at"] != "gpus"], ids=case_id)
def test_config_case(case, tmp_path, request):
    with pytest.raises(UserError) as e:
        check_config(case, tmp_path, request)
    assert_one_line(str(e.value), case["expect"]["error"])


@pytest.mark.parametrize("case", [c for c in CONFIG_CASES if c["at"] == "gpus"], ids=case_id)
def test_tp_size_larger_than_the_host(case, tmp_path, monkeypatch):
    from eagle3prep.infra.gpus import claim_gpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = validate_config(merged({"data": {"sources": [GOOD_SOURCE]}, "model": {"path": "m"}}, case["config"]))
    # A UserError: the extract job prints it as one `error:` line, no traceback.
    with pytest.raises(UserError) as e:
        claim_gpus(config["extract"]["tp_size"], num_gpus=case["gpus"], lock_dir=tmp_path, wait_s=0)
    assert_one_line(str(e.value), case["expect"]["error"], "lower extract.tp_size")


# ------------------------------------------------------------------------------ through the snakemake CLI


def cli_config(**override) -> dict:
    return merged(
        {
            "data": {"sources": ["resources/demo/sharegpt.jsonl"]},
            "model": {"path": "results/demo/model", "build_demo": True},
        },
        override,
    )


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error" in line.lower()]


@pytest.mark.integration
@pytest.mark.parametrize(
    "override, message",
    [
        ({"tokenize": {"num_shards": 0}}, "config error: tokenize.num_shards = 0: 0 is less than the minimum of 1"),
        (
            {"data": {"sources": ["resources/demo/missing.jsonl"]}},
            "data.sources: 'resources/demo/missing.jsonl' does not exist",
        ),
    ],
    ids=["num_shards_0", "missing_source"],
)
def test_cli_parse_time_error_is_one_line(override, message, tmp_path):
    wd = make_workdir(tmp_path, cli_config(**override))
    proc = snakemake(wd, "-n", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if message in line], proc.stderr[-2000:]
    assert not (wd / "results").exists()


@pytest.mark.integration
def test_cli_missing_model_folder_is_one_line_before_any_job(tmp_path):
    # Was Snakemake's multi-line MissingInputException in a fresh folder, and nothing at all once results
    # existed (only the report reran, recording a model path that was never used).
    wd = make_workdir(tmp_path, cli_config(model={"path": "no/such/model", "build_demo": False}))
    proc = snakemake(wd, "-n", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "MissingInput" not in proc.stderr
    assert error_lines(proc.stderr) == [
        f"config error: model.path = 'no/such/model': no such folder (cwd: {wd}); set model.path to a local "
        "Hugging Face model folder (or model.build_demo: true to build the demo model there)"
    ]


@pytest.mark.integration
def test_cli_bad_source_fails_the_prepare_job_with_one_line(tmp_path):
    wd = make_workdir(tmp_path, cli_config(data={"sources": ["resources/demo/sharegpt.jsonl", "not_a_dataset"]}))
    shutil.copytree(BAD / "sources" / "not_a_dataset", wd / "not_a_dataset")
    proc = snakemake(wd, "results/prepared/counts.json", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    log = (wd / "logs" / "prepare.log").read_text()
    assert log.splitlines() == [
        "error: not_a_dataset: is a folder but not a Hugging Face dataset saved with save_to_disk "
        "(expected state.json and dataset_info.json in it; found notes.txt)"
    ]
    assert log.strip() in proc.stderr  # the profile's show-failed-logs prints it under the failed job
    assert not (wd / "results" / "prepared").exists() or not any((wd / "results" / "prepared").iterdir())


@pytest.mark.integration
@pytest.mark.parametrize(
    "override, message",
    [
        (
            {"tokenize": {"max_seq_len": 4096}},
            "config error: tokenize.max_seq_len = 4096 is above the model's context of 1024 tokens "
            "(max_position_embeddings in {model}/config.json); set it to 1024 or less",
        ),
        (  # vLLM samples a token after the row: the engine would refuse max_model_len 1025 after the GPU jobs
            {"tokenize": {"max_seq_len": 1024}, "extract": {"backend": "vllm"}},
            "config error: tokenize.max_seq_len = 1024 fills the model's context of 1024 tokens "
            "(max_position_embeddings in {model}/config.json), and extract.backend vllm samples one token after "
            "each row; set it to 1023 or less",
        ),
        (
            {"layers": {"ids": [2, 4, 99]}},
            "config error: layers.ids = [2, 4, 99] has ids [99] outside 0..8 (the model has N = 8 decoder layers; "
            "id 8 is the pre-norm final state)",
        ),
    ],
    ids=["max_seq_len", "max_seq_len_vllm", "layer_ids"],
)
def test_cli_what_the_model_config_decides_fails_the_dry_run_in_one_line(override, message, tmp_path, demo_model_dir):
    # Both were found only inside the jobs (layer ids once per extract job), after prepare and tokenize.
    wd = make_workdir(tmp_path, cli_config(model={"path": str(demo_model_dir), "build_demo": False}, **override))
    proc = snakemake(wd, "-n", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert error_lines(proc.stderr) == [message.format(model=demo_model_dir)]
    assert not (wd / "results").exists()


@pytest.mark.integration
@pytest.mark.parametrize("allow", [False, True], ids=["default", "allow_no_user_turn"])
def test_cli_a_conversation_without_a_user_turn(tmp_path, allow):
    # Issue #24: prepare kept it ("3 rows in, 3 kept"), and tokenize made a row of an assistant turn answering
    # nobody. data.allow_no_user_turn (completion-style data) reaches the prepare job as a rule param.
    data = {"sources": ["no_user_turn.jsonl"], **({"allow_no_user_turn": True} if allow else {})}
    wd = make_workdir(tmp_path, cli_config(data=data))
    no_user = json.dumps({"messages": [{"role": "assistant", "content": "I start."}]})
    (wd / "no_user_turn.jsonl").write_text("\n".join([good_line(1), no_user, good_line(3)]) + "\n")
    snakemake(wd, "results/prepared/counts.json")
    totals = json.loads((wd / "results" / "prepared" / "counts.json").read_text())["totals"]
    log = (wd / "logs" / "prepare.log").read_text()
    if allow:
        assert (totals["kept"], totals["quarantined_total"]) == (3, 0)
        assert "3 rows in, 3 kept, 0 duplicates, 0 quarantined" in log
    else:
        assert (totals["kept"], totals["quarantined"]["no_user_turn"]) == (2, 1)
        assert "3 rows in, 2 kept, 0 duplicates, 1 quarantined (no_user_turn 1)" in log
        quarantine = (wd / "results" / "prepared" / "quarantine.jsonl").read_text().splitlines()
        assert [(q["line"], q["reason"]) for q in map(json.loads, quarantine)] == [(2, "no_user_turn")]


# ------------------------------------------------------------------------------ issue #27: configs of one's own


def config_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("eagle3prep: config ")]


@pytest.mark.integration
def test_cli_a_configfile_is_the_whole_config_not_laid_over_the_demos(tmp_path, demo_model_dir):
    """A config file without data.sources ran on the demo's files and inherited num_shards and build_demo."""
    wd = make_workdir(tmp_path / "wd")  # its config/config.yaml: the small demo (3 shards, build_demo: true)
    mine = tmp_path / "my-run.yaml"
    mine.write_text(yaml.safe_dump({"model": {"path": str(demo_model_dir)}, "tokenize": {"max_seq_len": 128}}))
    proc = snakemake(wd, "-n", "--configfile", str(mine), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert error_lines(proc.stderr) == [
        "config error: data.sources is required and missing (Raw conversation files or HF save_to_disk folders, "
        "read in this order (row ids follow it))"
    ]
    assert config_lines(proc.stderr) == [
        f"eagle3prep: config {mine} over the schema's defaults (eagle3prep/config/schema.yaml; the demo's config/config.yaml "
        f"is not read); results in {wd}/results"
    ]
    mine.write_text(mine.read_text() + "data: {sources: [resources/demo/openai.jsonl]}\n")
    out = snakemake(wd, "-n", "--configfile", str(mine)).stdout
    assert re.search(r"^extract\s+1$", out, re.M), out  # the schema's num_shards: 1, not 3
    assert "build_demo_model" not in out
    # Without --configfile the demo's config is in force, and said so.
    proc = snakemake(wd, "-n")
    assert re.search(r"^extract\s+3$", proc.stdout, re.M)
    assert config_lines(proc.stderr)[0].startswith("eagle3prep: config config/config.yaml (the demo's;")


@pytest.mark.integration
def test_cli_a_model_folder_without_a_tokenizer_fails_the_dry_run_in_one_line(tmp_path, model_variants):
    """It passed `-n`; the tokenize job then died with a 28-line traceback."""
    model = model_variants["no_tokenizer"]
    wd = make_workdir(
        tmp_path, cli_config(model={"path": str(model), "build_demo": False}, tokenize={"max_seq_len": 128})
    )
    proc = snakemake(wd, "-n", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    [line] = error_lines(proc.stderr)
    assert line.startswith(f"config error: model.path = {model}: the folder has no tokenizer files (")


@pytest.mark.integration
def test_cli_plan_after_configfile_and_a_results_folder_elsewhere(tmp_path, demo_model_dir):
    """`snakemake --configfile config/my-run.yaml plan` was Snakemake's `FileNotFoundError: ... 'plan'`. Results
    go where --directory says; the config names relative paths from there, so this one is absolute."""
    mine = tmp_path / "my-run.yaml"
    sources = [str(REPO / "resources/demo/sharegpt.jsonl")]
    config = {"data": {"sources": sources}, "model": {"path": str(demo_model_dir)}, "tokenize": {"max_seq_len": 128}}
    mine.write_text(yaml.safe_dump(config))
    run = tmp_path / "big-disk" / "run1"

    def from_the_repo(*args: str) -> subprocess.CompletedProcess:
        cmd = [str(Path(sys.executable).with_name("snakemake")), *args, "--directory", str(run), "-n"]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)

    proc = from_the_repo("--configfile", str(mine), "plan")  # Snakemake reads `plan` as a config file
    assert proc.returncode != 0 and "No such file or directory: 'plan'" in proc.stdout + proc.stderr
    proc = from_the_repo("plan", "--configfile", str(mine))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^plan\s+1$", proc.stdout, re.M)
    assert config_lines(proc.stderr)[0].endswith(f"results in {run}/results")
