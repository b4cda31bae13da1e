"""`snakemake verify` / eagle3prep.verify: checksums against the manifests, one line per damaged file.

A demo-sized shard (the demo model, hf backend) is copied into a results folder as shards 0..3, then
broken one way per test: verify must print exactly the line naming that file, and fail.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from eagle3prep.extract import extract_shard
from eagle3prep.infra.atomic import sha256_file
from eagle3prep.settings import ExtractSettings
from eagle3prep.shard import MANIFEST
from eagle3prep.verify import main, verify

from testkit.shards import demo_spec, with_settings, write_tokenized

LENGTHS = [23, 41, 17]


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory, demo_model_dir):
    root = tmp_path_factory.mktemp("verify_shard")
    tokens = write_tokenized(root / "tokens.jsonl", LENGTHS, seed=0)
    extract_shard(
        str(tokens),
        str(root / "shard"),
        with_settings(
            demo_spec(demo_model_dir), ExtractSettings.defaults(batch_tokens=128, logprob_rows=0)
        ),  # six files a shard: no logprobs
        shard=0,
    )
    return root / "shard"


@pytest.fixture
def results(one_shard, tmp_path):
    """results/hidden_states/shard_0..3, copies of one good shard (verify reads each against its own manifest)."""
    for k in range(4):
        shutil.copytree(one_shard, tmp_path / "results" / "hidden_states" / f"shard_{k}")
    return tmp_path / "results"


def flip_byte(path, at: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_good_results_folder_verifies_in_one_line(results, capsys):
    verdict = verify(results, [0, 1, 2, 3])
    assert verdict.ok and verdict.shards == 4 and verdict.files == 4 * 6  # 4 layers, token ids, index
    assert main([str(results)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("verify: ok: 24 files of 4 shards")


def test_a_flipped_byte_is_one_line_naming_the_file_and_both_hashes(results, capsys):
    layer = results / "hidden_states" / "shard_3" / "layer_4.safetensors"
    recorded = json.loads((layer.parent / MANIFEST).read_text())["files"]["layer_4.safetensors"]["sha256"]
    flip_byte(layer)
    now, mtime = sha256_file(layer), layer.stat().st_mtime_ns
    assert main([str(results)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"shard_3/layer_4.safetensors: sha256 {now[:12]} != {recorded[:12]}"
    assert len(out) == 2 and out[1].startswith("verify: 1 damaged of 24 files of 4 shards")
    assert out[1].endswith(
        "the next run of the same command makes them again: snakemake (with your --configfile and --directory)"
    )
    assert layer.stat().st_mtime_ns == mtime and sha256_file(layer) == now  # verify only reads


def test_truncated_missing_stray_and_absent_shard_each_get_their_line(results):
    hs = results / "hidden_states"
    (hs / "shard_0" / "index.json").write_bytes((hs / "shard_0" / "index.json").read_bytes()[:-5])
    (hs / "shard_1" / "token_ids.safetensors").unlink()
    (hs / "shard_2" / "notes.txt").write_text("x")
    verdict = verify(results, [0, 1, 2, 3, 4])
    lines = set(verdict.damaged)
    assert len(lines) == 4, verdict.damaged
    assert any(re.fullmatch(r"shard_0/index\.json: \d+ bytes, manifest says \d+ \(truncated\?\)", x) for x in lines)
    assert "shard_1/token_ids.safetensors: listed in the manifest but missing" in lines
    assert "shard_2/notes.txt: not in the manifest" in lines
    assert "shard_4: missing (not extracted yet, or removed)" in lines
    assert not verdict.ok and set(verdict.bad_places) == {f"hidden_states/shard_{k}" for k in (0, 1, 2, 4)}


def test_an_unfinished_shard_and_a_changed_manifest(results):
    hs = results / "hidden_states"
    (hs / "shard_1" / MANIFEST).unlink()  # a capture that never finished
    (results / "report").mkdir()
    recorded = [
        {"dir": f"results/hidden_states/shard_{k}", "manifest_sha256": sha256_file(hs / f"shard_{k}" / MANIFEST)}
        for k in (0, 2)
    ]
    (results / "report" / "dataset_manifest.json").write_text(json.dumps({"shards": recorded}))
    m = json.loads((hs / "shard_2" / MANIFEST).read_text())
    m["rows"] += 1  # a manifest edited after the report pinned it: its files still match it
    (hs / "shard_2" / MANIFEST).write_text(json.dumps(m))
    verdict = verify(results, [0, 1, 2])
    assert verdict.damaged[0] == "shard_1/manifest.json: missing: the capture did not finish"
    assert re.fullmatch(
        r"shard_2/manifest\.json: sha256 \w{12} != \w{12} \(.*report/dataset_manifest\.json\)", verdict.damaged[1]
    )
    assert len(verdict.damaged) == 2


def test_the_export_is_checked_against_its_own_manifest(results):
    export = results / "export" / "speculators"
    (export / "hidden_states").mkdir(parents=True)
    (export / "hidden_states" / "hs_0.safetensors").write_bytes(b"abc" * 100)
    (export / "token_freq.pt").write_bytes(b"t" * 10)
    files = {
        name: {"sha256": sha256_file(export / name), "bytes": (export / name).stat().st_size}
        for name in ("hidden_states/hs_0.safetensors", "token_freq.pt")
    }
    (export / MANIFEST).write_text(json.dumps({"files": files, "sources": []}))
    assert verify(results).ok and verify(results).export_files == 2
    flip_byte(export / "hidden_states" / "hs_0.safetensors", 7)
    verdict = verify(results)
    assert [x.split(": ")[0] for x in verdict.damaged] == ["export/speculators/hidden_states/hs_0.safetensors"]
    assert set(verdict.bad_places) == {"export/speculators"}


def test_snakemakes_marker_in_the_export_folder_is_not_damage(results):
    # Snakemake writes .snakemake_timestamp into every directory() output, the export's included.
    export = results / "export" / "speculators"
    export.mkdir(parents=True)
    (export / "token_freq.pt").write_bytes(b"t" * 10)
    files = {"token_freq.pt": {"sha256": sha256_file(export / "token_freq.pt"), "bytes": 10}}
    (export / MANIFEST).write_text(json.dumps({"files": files, "sources": []}))
    (export / ".snakemake_timestamp").write_text("")
    verdict = verify(results)
    assert verdict.ok, verdict.damaged
    assert verdict.export_files == 1


def test_a_results_folder_that_is_not_one_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path)])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: {tmp_path}: no hidden_states/ folder; give the results folder of a run"


def test_the_cli_counts_a_removed_shard_that_tokenize_made(results):
    (results / "tokenized").mkdir()
    for k in range(5):
        (results / "tokenized" / f"shard_{k}.jsonl").write_text("")
    verdict = verify(results)  # no shard list: the folders and the tokenized shards
    assert verdict.damaged == ["shard_4: missing (not extracted yet, or removed)"]
    assert "makes them again: snakemake" in verdict.summary(results)


@pytest.mark.integration
def test_snakemake_verify_runs_only_itself_and_fails_on_a_flipped_byte(small_demo_run, tmp_path):
    from testkit.workflow import snakemake

    wd = shutil.copytree(small_demo_run, tmp_path / "wd", symlinks=True)
    ok = snakemake(wd, "verify")
    assert "verify: ok: 18 files of 3 shards" in ok.stderr  # six a shard: no prompt logprobs under the full reference
    flip_byte(wd / "results/hidden_states/shard_1/layer_5.safetensors")
    bad = snakemake(wd, "verify", check=False)
    lines = [x for x in bad.stderr.splitlines() if x.startswith("shard_")]
    assert bad.returncode != 0 and len(lines) == 1 and lines[0].startswith("shard_1/layer_5.safetensors: sha256 ")
    jobs = re.findall(r"^(?:local)?rule (\w+):", ok.stderr + bad.stderr, re.M)
    assert set(jobs) == {"verify"}  # no extract, validate or report job was queued


def test_what_verify_finds_is_recorded_for_the_next_run_and_its_command_is_the_users(results, monkeypatch):
    from eagle3prep.run import command

    monkeypatch.setenv(command.ENV, "snakemake --directory runs/a --configfile mine.yaml")
    flip_byte(results / "hidden_states" / "shard_2" / "layer_4.safetensors")
    verdict = verify(results, [0, 1, 2, 3])
    assert verdict.summary(results).endswith(
        "the next run of the same command makes them again: snakemake --directory runs/a --configfile mine.yaml"
    )
    verdict.write_record(results)
    places = json.loads((results / "verify.json").read_text())["places"]
    assert list(places) == ["hidden_states/shard_2"] and places["hidden_states/shard_2"].startswith(
        "shard_2/layer_4.safetensors: sha256 "
    )


def test_both_verify_commands_check_the_shards_of_the_dataset_and_leave_another_configs_alone(results, capsys):
    # Before: `snakemake verify` checked the config's num_shards, python -m eagle3prep.verify every folder.
    (results / "tokenized").mkdir()
    stats = {"shards": [{"shard": k, "rows": 3, "tokens": 81} for k in (0, 1)]}
    (results / "tokenized" / "stats.json").write_text(json.dumps(stats))
    (results / "hidden_states" / "shard_3" / "layer_4.safetensors").unlink()  # another config's, left behind
    verdict = verify(results)  # what scripts/verify.py (snakemake verify) runs
    assert verdict.ok and verdict.shards == 2 and verdict.left_alone == ["shard_2", "shard_3"]
    assert main([str(results)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0].startswith("not checked: shard_2, shard_3 (not in ") and "left by a config with more shards" in out[0]
    )
    assert out[1].startswith("verify: ok: 12 files of 2 shards")


def test_a_healthy_folder_is_left_as_it_is_and_a_record_of_damage_is_cleared(results):
    """verify on a healthy folder wrote results/verify.json: a read-only command changed results/."""
    verify(results, [0, 1, 2, 3]).write_record(results)
    assert not (results / "verify.json").exists()
    data = (results / "hidden_states" / "shard_2" / "layer_4.safetensors").read_bytes()
    flip_byte(results / "hidden_states" / "shard_2" / "layer_4.safetensors")
    verify(results, [0, 1, 2, 3]).write_record(results)
    assert list(json.loads((results / "verify.json").read_text())["places"]) == ["hidden_states/shard_2"]
    (results / "hidden_states" / "shard_2" / "layer_4.safetensors").write_bytes(data)  # put back by hand
    verify(results, [0, 1, 2, 3]).write_record(results)
    assert json.loads((results / "verify.json").read_text()) == {"places": {}}
    stamp = (results / "verify.json").stat().st_mtime_ns
    verify(results, [0, 1, 2, 3]).write_record(results)
    assert (results / "verify.json").stat().st_mtime_ns == stamp
