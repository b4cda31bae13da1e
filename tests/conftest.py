"""Shared pytest fixtures. Each fixture is self-contained; add new ones below, clearly named."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_CORPUS = REPO_ROOT / "resources" / "demo" / "tokenizer_corpus.txt"


def pytest_collection_modifyitems(items):
    """A test on small_demo_run, directly or through another fixture, waits on a Snakemake run: integration
    (`make test-fast` leaves it out)."""
    for item in items:
        if "small_demo_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    """The offline demo model + tokenizer (eagle3prep.demo), built once per test session (~5 s).

    Read-only for tests: copy the files you want to change into your own tmp_path.
    """
    from eagle3prep.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo_model") / "model", DEMO_CORPUS)


@pytest.fixture(scope="session")
def small_demo_run(tmp_path_factory) -> Path:
    """One local `snakemake` run of testkit.workflow.SMALL_CONFIG (~1-2 min on 2 cores), shared by the tests
    that compare against it or report on it. Read-only for tests: work in your own tmp_path.
    """
    from testkit.workflow import make_workdir, snakemake

    wd = make_workdir(tmp_path_factory.mktemp("small_demo_run"))
    snakemake(wd)
    return wd


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory) -> Path:
    """The tiny random Qwen2.5-VL target (testkit.tiny_vl), built once per session (~15 s on 2 cores).
    Read-only for tests."""
    from testkit.tiny_vl import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("tiny_vl") / "qwen2_5_vl")


@pytest.fixture(scope="session")
def image_run(tmp_path_factory, tiny_vl_dir) -> Path:
    """A finished run of conversations with images up to validation (tests/testkit/image_run.py), built once per session.
    Read-only for tests: write reports and exports into your own tmp_path."""
    from testkit.image_run import build_image_run

    return build_image_run(tmp_path_factory.mktemp("image_run"), tiny_vl_dir)
