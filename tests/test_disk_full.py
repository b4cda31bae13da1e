"""A full disk, two ways, on a real size-limited filesystem (tmpfs mounted with `size=`; needs root).

(a) The shard cannot fit: the pre-check refuses with one line of numbers, before the engine starts
    and before any shard file exists.
(b) The pre-check passes, then the disk fills during the write (a ballast file, written once every
    check has passed): the job fails with a one-line DiskSpaceError naming the file and the free
    space, and leaves neither a manifest nor a temp file; a rerun with room completes and validates.
Both go through the package; the last test does (a) and the rerun through the snakemake CLI.
"""

import json
import os
import re
import shutil
import subprocess

import pytest

from eagle3prep.extract import extract_shard, shard_bytes
from eagle3prep.extract import stage as extract
from eagle3prep.infra.disk import DiskSpaceError
from eagle3prep.settings import ExtractSettings
from eagle3prep.shard.formats import storage_format
from eagle3prep.shard.layout import MANIFEST
from eagle3prep.shard.writer import ShardWriter

from testkit import calls
from testkit.shards import DEMO_LAYER_IDS, demo_spec, with_settings, write_tokenized
from testkit.workflow import make_workdir, snakemake

LENGTHS = [100] * 20  # 2000 tokens x 4 layers x 128 x bf16: a ~2 MiB shard
NEEDED = shard_bytes(sum(LENGTHS), len(LENGTHS), len(DEMO_LAYER_IDS), 128, "bfloat16", storage_format("model_dtype"))


@pytest.fixture
def small_fs():
    """mount(path, size) -> path: a tmpfs of `size` at `path`, unmounted after the test."""
    mounted = []

    def mount(path, size: str):
        if os.geteuid() != 0:
            pytest.skip("mounting a size-limited tmpfs needs root (CAP_SYS_ADMIN); not running as root")
        path.mkdir(parents=True, exist_ok=True)
        try:
            proc = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
            )
        except FileNotFoundError:
            pytest.skip("no `mount` command on this machine")
        if proc.returncode != 0:
            pytest.skip(f"mounting a size-limited tmpfs is not permitted here: {proc.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", str(path)], check=False)


def fill(ballast, leave: int) -> None:
    """Write zeros into `ballast` until only about `leave` bytes stay free on its filesystem."""
    todo = shutil.disk_usage(ballast.parent).free - leave
    with open(ballast, "wb") as f:
        while todo > 0:
            n = min(todo, 1 << 20)
            f.write(b"\0" * n)
            todo -= n


def test_precheck_refuses_a_shard_bigger_than_the_free_space(small_fs, tmp_path, demo_model_dir, monkeypatch):
    fs = small_fs(tmp_path / "fs", "256k")
    tokens = write_tokenized(tmp_path / "tokens.jsonl", LENGTHS, seed=0)
    monkeypatch.setattr(extract, "make_backend", lambda *a: pytest.fail("the engine started before the pre-check"))
    with pytest.raises(DiskSpaceError) as e:
        extract_shard(
            str(tokens),
            str(fs / "shard_0"),
            with_settings(demo_spec(demo_model_dir), ExtractSettings.defaults(batch_tokens=512)),
            shard=0,
        )
    m = re.fullmatch(
        r"not enough disk for \S+/shard_0: the shard needs [\d.]+ MiB \((\d+) bytes\), \S+ has [\d.]+ KiB "
        r"\((\d+) bytes\) free; .*`snakemake plan`.*",
        str(e.value),
    )
    assert m, str(e.value)
    assert int(m[1]) == NEEDED and int(m[2]) <= 256 * 1024
    assert list((fs / "shard_0").iterdir()) == []  # no layer file, no temp file, no manifest


def test_disk_full_during_the_write_then_a_rerun_with_room(small_fs, tmp_path, demo_model_dir, monkeypatch):
    fs = small_fs(tmp_path / "fs", "4m")
    tokens = write_tokenized(tmp_path / "tokens.jsonl", LENGTHS, seed=0)
    out, ballast = fs / "shard_0", fs / "ballast"

    class FillingWriter(ShardWriter):
        def __init__(self, *args, **kwargs):
            fill(ballast, leave=NEEDED // 2)  # every pre-check has passed by now; someone else fills the disk
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(extract, "ShardWriter", FillingWriter)
    with pytest.raises(DiskSpaceError) as e:
        extract_shard(
            str(tokens),
            str(out),
            with_settings(demo_spec(demo_model_dir), ExtractSettings.defaults(batch_tokens=512)),
            shard=0,
        )
    m = re.fullmatch(
        r"disk full while writing \S+/shard_0/(layer_\d+|token_ids)\.safetensors: [\d.]+ \w+ \((\d+) bytes\) "
        r"free on its filesystem now; .*`snakemake plan`.*",
        str(e.value),
    )
    assert m, str(e.value)
    assert int(m[2]) < NEEDED // 2
    assert list(out.iterdir()) == []  # the unfinished shard's files are gone, temp files included

    monkeypatch.undo()
    ballast.unlink()
    manifest = extract_shard(
        str(tokens),
        str(out),
        with_settings(demo_spec(demo_model_dir), ExtractSettings.defaults(batch_tokens=512)),
        shard=0,
    )
    report = calls.validate(out, tokens, tmp_path / "v.json", demo_model_dir, sample_rows=1)
    assert report["ok"] and manifest.tokens == sum(LENGTHS)
    assert not list(out.glob(".tmp-*"))
    on_disk = sum(p.stat().st_size for p in out.iterdir())
    assert 0.95 * NEEDED < on_disk <= NEEDED  # the estimate the pre-check and `plan` use is safe and tight


@pytest.mark.integration
def test_cli_plan_and_refusal_on_a_small_filesystem_then_rerun_with_room(small_fs, tmp_path):
    wd = make_workdir(tmp_path / "wd")
    fs = small_fs(wd / "results" / "hidden_states", "512k")

    planned = snakemake(wd, "plan")
    plan = json.loads((wd / ".eagle3prep/plan/plan.json").read_text())
    assert plan["free_space_path"] == str(fs) and plan["largest_shard_bytes"] > plan["free_bytes"]
    assert not plan["fits"] and "DOES NOT FIT" in planned.stdout
    assert (wd / ".eagle3prep/plan/plan.txt").read_text() in planned.stdout

    refused = snakemake(wd, "results/hidden_states/shard_0", check=False)
    assert refused.returncode != 0
    log = (wd / "logs/extract/shard_0.log").read_text()
    assert re.search(
        r"^error: not enough disk for results/hidden_states/shard_0: the shard needs .* bytes\), .* bytes\) free; ",
        log,
        re.M,
    ), log
    assert "Traceback" not in log
    assert not (fs / "shard_0" / MANIFEST).exists()

    subprocess.run(["mount", "-o", "remount,size=64m", str(fs)], check=True)
    snakemake(wd, "results/validation/shard_0.json")
    assert json.loads((wd / "results/validation/shard_0.json").read_text())["ok"]
    assert not list((wd / "results").rglob(".tmp-*"))
    snakemake(wd, "-f", "plan")  # -f: plan again, with the new free space
    plan = json.loads((wd / ".eagle3prep/plan/plan.json").read_text())
    assert plan["fits"] and [s["done"] for s in plan["shards"]] == [True, False, False]
