"""Shared pytest fixtures. Each fixture is self-contained; add new ones below, clearly named."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_CORPUS = REPO_ROOT / "resources" / "demo" / "tokenizer_corpus.txt"


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    """The offline demo model + tokenizer (eagle3prep.demo), built once per test session (~5 s).

    Read-only for tests: copy the files you want to change into your own tmp_path.
    """
    from eagle3prep.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo_model") / "model", DEMO_CORPUS)
