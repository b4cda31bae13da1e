import json
import os
import subprocess
import sys

import pytest

from eagle3prep.infra.atomic import TMP_PREFIX, atomic_open, remove_stale_temps, sha256_file, write_json, write_jsonl


def test_atomic_write_replaces_whole_file(tmp_path):
    p = tmp_path / "a.json"
    write_json(p, {"b": 1, "a": [1, 2]})
    assert json.loads(p.read_text()) == {"a": [1, 2], "b": 1}
    assert p.read_text().index('"a"') < p.read_text().index('"b"')  # sorted keys: equal objects, equal bytes
    assert [f.name for f in tmp_path.iterdir()] == ["a.json"]


def test_exception_keeps_old_file_and_removes_temp(tmp_path):
    p = tmp_path / "rows.jsonl"
    write_jsonl(p, [{"x": 1}])
    with pytest.raises(RuntimeError), atomic_open(p, "w") as f:
        f.write('{"x": 2}\n{"half')
        raise RuntimeError("crash mid-write")
    assert p.read_text() == '{"x":1}\n'
    assert sorted(f.name for f in tmp_path.iterdir()) == ["rows.jsonl"]


def test_sigkill_mid_write_never_leaves_a_final_file(tmp_path):
    target = tmp_path / "big.bin"
    code = f"""
import os, signal
from eagle3prep.infra.atomic import atomic_open
with atomic_open({str(target)!r}, "wb") as f:
    f.write(b"x" * 1000)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", code])
    assert proc.returncode == -9
    assert not target.exists()
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(TMP_PREFIX)
    assert remove_stale_temps(tmp_path) and not list(tmp_path.iterdir())


def test_sha256_file(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"abc")
    assert sha256_file(p) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert os.path.getsize(p) == 3
