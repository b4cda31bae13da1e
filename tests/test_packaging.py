"""The wheel holds what an installed package reads beside its code: the config's schema is package data, found
next to eagle3prep/config/schema.py, so a non-editable install validates a config as a checkout does."""

import importlib.util
import shutil
import subprocess
import sys
import zipfile

import pytest

from testkit.workflow import REPO


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="the build backend is not installed")
def test_the_wheel_ships_the_schema_the_package_reads(tmp_path):
    # A copy of what the build reads, so the build's own folders (build/, *.egg-info) stay out of the checkout.
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, tree / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp_path / "dist"), str(tree)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("eagle3prep-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        shipped = z.read("eagle3prep/config/schema.yaml") if "eagle3prep/config/schema.yaml" in names else None
    assert shipped is not None, sorted(n for n in names if n.startswith("eagle3prep/config/"))
    # The one schema: what the package reads is the file the wheel ships, byte for byte.
    from eagle3prep.config import SCHEMA

    assert SCHEMA == REPO / "src" / "eagle3prep" / "config" / "schema.yaml"
    assert shipped == SCHEMA.read_bytes()
    assert not (REPO / "config" / "schema.yaml").exists(), "a second schema beside the package's"
