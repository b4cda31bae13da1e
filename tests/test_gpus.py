"""GPU claiming with lock files, on fake GPU counts (no GPU needed).

flock locks belong to an open file description, so two claims in one process conflict exactly like
two jobs on one host do; that is what lets these tests stand in for parallel Snakemake jobs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from eagle3prep.infra import gpus


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.delenv(gpus.LOCK_DIR_ENV, raising=False)


def test_claim_sets_cuda_visible_devices_and_release_restores(tmp_path):
    with gpus.claim_gpus(2, lock_dir=tmp_path, num_gpus=4) as claim:
        assert claim.ids == [0, 1] and claim.source == "locks"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # same numbering as nvidia-smi
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert "CUDA_DEVICE_ORDER" not in os.environ


def test_parallel_jobs_get_disjoint_gpus(tmp_path, monkeypatch):
    first = gpus.claim_gpus(2, lock_dir=tmp_path, num_gpus=4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # the second job is another process: its env is clean
    second = gpus.claim_gpus(2, lock_dir=tmp_path, num_gpus=4)
    assert first.ids == [0, 1] and second.ids == [2, 3]
    second.release()
    first.release()


def test_released_gpus_are_claimed_again(tmp_path):
    gpus.claim_gpus(3, lock_dir=tmp_path, num_gpus=4).release()
    with gpus.claim_gpus(4, lock_dir=tmp_path, num_gpus=4) as claim:
        assert claim.ids == [0, 1, 2, 3]


def test_busy_host_times_out_with_a_clear_error(tmp_path, monkeypatch):
    held = gpus.claim_gpus(3, lock_dir=tmp_path, num_gpus=4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match=r"could not claim 2 free GPU\(s\) of 4"):
        gpus.claim_gpus(2, lock_dir=tmp_path, num_gpus=4, wait_s=0.2, poll_s=0.05)
    held.release()


def test_too_few_gpus_on_the_host(tmp_path):
    with pytest.raises(RuntimeError, match=r"tp_size = 8 but this host has 4 GPU"):
        gpus.claim_gpus(8, lock_dir=tmp_path, num_gpus=4)


def test_preset_cuda_visible_devices_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # e.g. SLURM
    with gpus.claim_gpus(2, lock_dir=tmp_path, num_gpus=8) as claim:
        assert claim.source == "CUDA_VISIBLE_DEVICES"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"  # not ours to undo
    assert list(tmp_path.iterdir()) == []  # no lock taken


def test_preset_cuda_visible_devices_with_too_few_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(RuntimeError, match=r"CUDA_VISIBLE_DEVICES='3' makes only 1 GPU"):
        gpus.claim_gpus(2)


def test_zero_gpus_claims_nothing():
    assert gpus.claim_gpus(0).ids == []


def test_lock_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(gpus.LOCK_DIR_ENV, str(tmp_path / "locks"))
    with gpus.claim_gpus(1, num_gpus=2):
        assert (tmp_path / "locks" / "gpu0.lock").exists()


def test_a_dead_job_frees_its_gpus(tmp_path):
    """The kernel drops a flock when its process dies: no stale lock after a crash."""
    script = textwrap.dedent(
        f"""
        import os
        from eagle3prep.infra import gpus
        gpus.claim_gpus(2, lock_dir={str(tmp_path)!r}, num_gpus=2)
        os._exit(1)  # dies without releasing
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    subprocess.run([sys.executable, "-c", script], env=env, check=False)
    with gpus.claim_gpus(2, lock_dir=tmp_path, num_gpus=2) as claim:
        assert claim.ids == [0, 1]


def test_count_gpus_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(gpus.shutil, "which", lambda name: None)
    assert gpus.count_gpus() == 0
