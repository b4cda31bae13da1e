"""infra/folder.py: the output folder lifecycle extract, regenerate and export share."""

import json

import pytest

from eagle3prep.infra import faults
from eagle3prep.infra.atomic import TMP_PREFIX, atomic_open
from eagle3prep.infra.folder import MANIFEST, TIMINGS, file_entry, finish_folder, open_folder


def test_open_removes_the_manifest_temps_and_named_outputs_and_nothing_else(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    for name in (MANIFEST, f"{TMP_PREFIX}rows.arrow", "data-00000.arrow", "state.json", "mine.txt"):
        (out / name).write_text("old")
    (out / f"{TMP_PREFIX}arrow").mkdir()  # a killed export's staging folder
    (out / f"{TMP_PREFIX}arrow" / "x").write_text("old")
    (out / "hidden_states").mkdir()
    (out / "hidden_states" / "hs_0.safetensors").write_text("old")
    assert open_folder(out, ("data-*.arrow", "state.json", "hidden_states")) == out
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]  # a file the stage does not write stays
    assert open_folder(tmp_path / "new" / "shard_0").is_dir()  # made with its parents


def test_finish_writes_timings_then_the_kill_point_then_the_manifest(tmp_path, monkeypatch):
    out = open_folder(tmp_path / "shard_0")
    with atomic_open(out / "rows.jsonl", "w") as f:
        f.write("{}\n")
    seen = []
    monkeypatch.setattr(faults, "kill_point", lambda name, **kw: seen.append((name, kw, sorted(os_names(out)))))
    manifest = {"files": {"rows.jsonl": file_entry(out / "rows.jsonl")}}
    assert finish_folder(out, manifest, {"s": 1.5}, ("stage.before_manifest", {"shard": 0})) == manifest
    # timings.json renamed into place, then the stage's kill point, then the manifest renamed into place: last.
    assert [(name, kw) for name, kw, _ in seen] == [
        ("atomic.before_rename", {"file": TIMINGS}),
        ("stage.before_manifest", {"shard": 0}),
        ("atomic.before_rename", {"file": MANIFEST}),
    ]
    assert seen[1][2] == ["rows.jsonl", TIMINGS]
    assert json.loads((out / MANIFEST).read_text()) == manifest
    assert manifest["files"]["rows.jsonl"] == {
        "sha256": "ca3d163bab055381827226140568f3bef7eaac187cebd76878e0b63e9e442356",
        "bytes": 3,
    }


def test_a_kill_before_the_manifest_leaves_a_folder_the_next_open_redoes(tmp_path, monkeypatch):
    out = open_folder(tmp_path / "shard_0")
    (out / "rows.jsonl").write_text("{}\n")

    def die(name, **kw):
        if name == "stage.before_manifest":
            raise KeyboardInterrupt  # stands in for SIGKILL at that point

    monkeypatch.setattr(faults, "kill_point", die)
    with pytest.raises(KeyboardInterrupt):
        finish_folder(out, {"files": {}}, {"s": 1}, ("stage.before_manifest", {}))
    assert not (out / MANIFEST).exists() and (out / TIMINGS).exists()
    open_folder(out)  # the rerun: the manifest-less folder is redone from its start
    assert not (out / MANIFEST).exists()


def os_names(folder):
    return [p.name for p in folder.iterdir()]
