"""Planted corruption: every way a shard can go wrong is caught by validation, by the check meant for it.

Each test copies one good shard, breaks it one way, and asserts validate_shard raises ValidationError
whose failed checks are exactly the expected ones (from the `[validate] FAIL <check>:` log lines).
Where a corruption would be caught early by the checksums, the manifest is rewritten to match, so
that the later check (index, finite values, reference recomputation) has to catch it on its own.
Every test runs on shards stored as captured (model_dtype), as FP8 (extract.storage: fp8_e4m3) and as MXFP4.
"""

import json
import re
import shutil

import pytest
import torch

from eagle3prep.extract import extract_shard
from eagle3prep.infra.atomic import sha256_file
from eagle3prep.settings import ExtractSettings
from eagle3prep.shard import INDEX, MANIFEST, TOKEN_IDS
from eagle3prep.shard.fp8 import SCALES_KEY
from eagle3prep.shard.manifest import read_manifest
from eagle3prep.shard.readers import read_layer
from eagle3prep.validate import ValidationError

from testkit import calls
from testkit.shards import demo_spec, with_settings, write_tokenized
from testkit.writers import write_layer

LENGTHS = [23, 41, 17, 60, 35, 28]  # 204 tokens; shard 1 has the same lengths, other tokens


@pytest.fixture(scope="module", params=["model_dtype", "fp8_e4m3", "mxfp4"])
def good(request, tmp_path_factory, demo_model_dir):
    """Two finished bf16 shards of the demo model (the second only lends its manifest), in one storage."""
    root = tmp_path_factory.mktemp(f"good_{request.param}")
    out = {}
    for k in (0, 1):
        tokens = write_tokenized(root / f"tokens_{k}.jsonl", LENGTHS, seed=k, first_row=k * len(LENGTHS))
        settings = ExtractSettings.defaults(storage=request.param, batch_tokens=128)
        extract_shard(
            str(tokens), str(root / f"shard_{k}"), with_settings(demo_spec(demo_model_dir), settings), shard=k
        )
        out[k] = (root / f"shard_{k}", tokens)
    return out


@pytest.fixture
def shard(good, tmp_path):
    """A fresh copy of the good shard 0, for one test to break."""
    return shutil.copytree(good[0][0], tmp_path / "shard_0")


def failed_checks(shard, good, demo_model_dir, capsys, tmp_path) -> set[str]:
    with pytest.raises(ValidationError) as e:
        calls.validate(shard, good[0][1], tmp_path / "v.json", demo_model_dir, sample_rows=2)
    assert "\n" not in str(e.value) and not (tmp_path / "v.json").exists()
    failed = set(re.findall(r"^\[validate\] FAIL (\S+):", capsys.readouterr().err, re.M))
    assert failed and any(name in str(e.value) for name in failed)  # the message lists the first five
    return failed


def set_file(shard, name: str, data: bytes | None = None) -> None:
    """Replace a file's bytes (when given) and make the manifest's sha256 and size agree with it."""
    if data is not None:
        (shard / name).write_bytes(data)
    manifest = json.loads((shard / MANIFEST).read_text())
    manifest["files"][name].update(sha256=sha256_file(shard / name), bytes=(shard / name).stat().st_size)
    (shard / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def test_good_shard_passes_every_check(good, demo_model_dir, tmp_path):
    report = calls.validate(good[0][0], good[0][1], tmp_path / "v.json", demo_model_dir, sample_rows=2)
    assert report["ok"] and len(report["reference"]) == 2 * 4
    # Each file's size and mtime, as a rerun's healing compares them (healing.heal.changed_in_place).
    listed = json.loads((good[0][0] / MANIFEST).read_text())["files"]
    seen = report["files_seen"]
    assert set(seen) >= set(listed) | {MANIFEST}
    assert all(seen[n] == [(good[0][0] / n).stat().st_size, (good[0][0] / n).stat().st_mtime_ns] for n in seen)
    assert {c["check"] for c in report["checks"]} >= {"manifest", "token_ids", "index_rows", "reference:layer_4"}
    manifest = json.loads((good[0][0] / MANIFEST).read_text())
    assert manifest["model"]["trust_remote_code"] is False  # the default, recorded (hygiene)


def test_truncated_layer_file(shard, good, demo_model_dir, capsys, tmp_path):
    path = shard / "layer_4.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    assert failed_checks(shard, good, demo_model_dir, capsys, tmp_path) == {"file:layer_4.safetensors"}


def test_flipped_bytes(shard, good, demo_model_dir, capsys, tmp_path):
    path = shard / "layer_5.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert failed_checks(shard, good, demo_model_dir, capsys, tmp_path) == {"file:layer_5.safetensors"}


def test_a_failed_shard_names_the_users_own_command_that_redoes_it(shard, good, demo_model_dir, tmp_path, monkeypatch):
    from eagle3prep.run import command

    monkeypatch.setenv(command.ENV, "snakemake --configfile mine.yaml --directory runs/a")
    (shard / "layer_5.safetensors").unlink()
    with pytest.raises(ValidationError) as e:
        calls.validate(shard, good[0][1], tmp_path / "v.json", demo_model_dir, sample_rows=2)
    assert str(e.value).endswith(
        "the next run of the same command moves it to results/failed/ and extracts it again: "
        "snakemake --configfile mine.yaml --directory runs/a"
    )
    # heal.keep_failed, or a shard already redone heal.MAX_REDOS times: it is validated again in place, not moved.
    with pytest.raises(ValidationError) as e:
        calls.validate(shard, good[0][1], tmp_path / "v.json", demo_model_dir, sample_rows=2, keep_failed=True)
    assert "results/failed" not in str(e.value) and "moves it" not in str(e.value)
    assert str(e.value).endswith(
        f"the next run of the same command validates it again and fails, kept in place (heal.keep_failed), until it "
        f"passes or you remove {shard} (then it is extracted again): snakemake --configfile mine.yaml --directory runs/a"
    )
    monkeypatch.chdir(tmp_path)
    for copy in (f"{shard.name}", f"{shard.name}.1"):
        (tmp_path / "results/failed" / copy).mkdir(parents=True)
    with pytest.raises(ValidationError) as e:
        calls.validate(shard, good[0][1], tmp_path / "v.json", demo_model_dir, sample_rows=2)
    assert "validates it again and fails, not extracted again after 2 redos, until it passes" in str(e.value)


def test_swapped_layer_files(shard, good, demo_model_dir, capsys, tmp_path):
    a, b = shard / "layer_2.safetensors", shard / "layer_4.safetensors"
    a.rename(shard / "x")
    b.rename(a)
    (shard / "x").rename(b)
    assert failed_checks(shard, good, demo_model_dir, capsys, tmp_path) == {
        "file:layer_2.safetensors",
        "file:layer_4.safetensors",
    }


def test_manifest_from_another_shard(shard, good, demo_model_dir, capsys, tmp_path):
    shutil.copy(good[1][0] / MANIFEST, shard / MANIFEST)  # same sizes (same row lengths), other bytes
    files = json.loads((shard / MANIFEST).read_text())["files"]
    assert failed_checks(shard, good, demo_model_dir, capsys, tmp_path) == {f"file:{n}" for n in files}


def test_index_that_skips_a_row(shard, good, demo_model_dir, capsys, tmp_path):
    index = json.loads((shard / INDEX).read_text())
    del index[2]
    set_file(shard, INDEX, json.dumps(index).encode())
    assert failed_checks(shard, good, demo_model_dir, capsys, tmp_path) == {"row_count", "index_rows", "index_offsets"}


def test_capture_one_layer_off(shard, good, demo_model_dir, capsys, tmp_path):
    # Layer id 5 stored as 4 (same shape and dtype), checksums made to agree: only the recomputation can tell.
    set_file(shard, "layer_4.safetensors", (shard / "layer_5.safetensors").read_bytes())
    assert failed_checks(shard, good, demo_model_dir, capsys, tmp_path) == {"reference:layer_4"}


def test_nan_in_one_row(shard, good, demo_model_dir, capsys, tmp_path):
    path, storage = shard / "layer_5.safetensors", read_manifest(shard).storage_name
    hs = read_layer(path, dtype=torch.float32)  # [sum_T, H]
    hs[100, 7] = float("nan")  # one element of one token row (scaled: its scale, so the token or block, is NaN)
    write_layer(path, hs if storage != "model_dtype" else hs.to(torch.bfloat16), storage)
    set_file(shard, "layer_5.safetensors")
    assert failed_checks(shard, good, demo_model_dir, capsys, tmp_path) == {"finite:layer_5"}


def test_layer_file_in_the_other_storage(shard, good, demo_model_dir, capsys, tmp_path):
    # The right values (dequantized), stored the other way: FP8 in a bf16 shard, or bf16 in an FP8 shard.
    path, storage = shard / "layer_5.safetensors", read_manifest(shard).storage_name
    other = {"model_dtype": "fp8_e4m3", "fp8_e4m3": "mxfp4", "mxfp4": "model_dtype"}[storage]
    write_layer(path, read_layer(path, dtype=torch.bfloat16), other)
    set_file(shard, "layer_5.safetensors")
    assert failed_checks(shard, good, demo_model_dir, capsys, tmp_path) == {"shape:layer_5"}


def test_scales_off(shard, good, demo_model_dir, capsys, tmp_path):
    # Values kept, every scale of one layer 1.5x (FP8) or 2x (MXFP4's e8m0 byte + 1): intact-looking bytes,
    # wrong states (bf16: no scales).
    storage = read_manifest(shard).storage_name
    if storage == "model_dtype":
        pytest.skip("model_dtype shards hold no scales")
    from safetensors.torch import load_file

    from eagle3prep.shard.layout import safetensors_header

    path = shard / "layer_4.safetensors"
    t = load_file(path)
    t[SCALES_KEY] = t[SCALES_KEY] * 1.5 if storage == "fp8_e4m3" else t[SCALES_KEY] + 1
    layout = [(n, str(t[n].dtype).removeprefix("torch."), tuple(t[n].shape)) for n in ("hidden_states", SCALES_KEY)]
    body = b"".join(t[n].contiguous().view(torch.uint8).numpy().tobytes() for n, _, _ in layout)
    set_file(shard, path.name, safetensors_header(layout) + body)
    assert failed_checks(shard, good, demo_model_dir, capsys, tmp_path) == {"reference:layer_4"}


def test_missing_manifest(shard, good, demo_model_dir, capsys, tmp_path):
    (shard / MANIFEST).unlink()
    assert failed_checks(shard, good, demo_model_dir, capsys, tmp_path) == {"manifest"}


def test_stray_temp_file(shard, good, demo_model_dir, capsys, tmp_path):
    (shard / f".tmp-{TOKEN_IDS}").write_bytes(b"half a file")
    assert failed_checks(shard, good, demo_model_dir, capsys, tmp_path) == {"no_stray_files"}
