"""vllm/engine/ (what every job that starts vLLM shares), where tests/test_vllm_capture.py does not already cover
it: the one engine shutdown of the extract backend and the regenerate stage. Base environment, no vLLM."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from eagle3prep.infra import shm
from eagle3prep.vllm.engine.launch import shutdown_engine


class Core:
    def __init__(self, fails: bool):
        self.fails, self.calls = fails, 0

    def shutdown(self) -> None:
        self.calls += 1
        if self.fails:
            raise RuntimeError("the engine core is gone already")


@pytest.mark.parametrize("fails", [False, True])
def test_shutdown_stops_the_engine_drops_it_and_forgets_its_shm_record(tmp_path, monkeypatch, fails):
    monkeypatch.setenv(shm.LOCK_DIR_ENV, str(tmp_path / "locks"))
    record = shm.records_dir() / f"{os.getpid()}.json"
    record.parent.mkdir(parents=True)
    record.write_text("{}")
    core = Core(fails)
    owner = SimpleNamespace(llm=SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core)))
    shutdown_engine(owner)  # an error of vLLM's own shutdown is not the job's: the engine is dropped either way
    assert core.calls == 1 and owner.llm is None and not record.exists()
    record.write_text("{}")
    shutdown_engine(owner)  # closed twice (a failed probe, then close()): nothing left to do
    assert core.calls == 1 and record.exists()


def test_the_vllm_wing_imports_neither_vllm_nor_torch():
    """The Snakefile's parse imports the package: the wing stays light (vLLM and torch only inside functions)."""
    import subprocess

    code = (
        "import sys, eagle3prep.vllm.registry, eagle3prep.vllm.families, eagle3prep.vllm.memory,"
        " eagle3prep.vllm.engine.errors, eagle3prep.vllm.engine.launch, eagle3prep.vllm.engine.workarounds,"
        " eagle3prep.vllm.capture.backend, eagle3prep.vllm.capture.hooks.worker,"
        " eagle3prep.vllm.capture.builtin.connector, eagle3prep.vllm.capture.builtin.cpu_connector;"
        " print(sorted({'vllm', 'torch'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
