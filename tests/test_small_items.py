"""Small things a new user met: the DatasetDict hint names the training split, the install guide names the NVIDIA
driver the CUDA build of `make gpu-env` needs, and a plan of one GPU per job says "1 GPU"."""

import re
from pathlib import Path

import pytest

from eagle3prep.prepare import InputError
from eagle3prep.prepare.readers import HFDiskReader

REPO = Path(__file__).resolve().parents[1]
# The smallest Linux driver release of each CUDA major (NVIDIA's CUDA toolkit release notes, table 3).
MIN_DRIVER = {12: 525, 13: 580}


def test_a_datasetdict_hint_names_the_train_split_not_the_first_in_order(tmp_path):
    folder = tmp_path / "dd"
    for split in ("test", "train", "validation"):
        (folder / split).mkdir(parents=True)
        (folder / split / "state.json").write_text("{}")
    (folder / "dataset_dict.json").write_text('{"splits": ["test", "train", "validation"]}')
    with pytest.raises(InputError) as e:
        HFDiskReader.check(str(folder))
    assert str(e.value).endswith(f"list one split folder as a source, e.g. {folder / 'train'}")


def test_the_install_guide_names_the_driver_the_pinned_cuda_build_needs():
    pins = (REPO / "envs/gpu.txt").read_text()
    major = int(re.search(r"^nvidia-cuda-runtime==(\d+)\.", pins, re.M).group(1))
    guide = (REPO / "docs/guides/install.md").read_text()
    assert f"CUDA {major}.0 builds" in guide and f"release {MIN_DRIVER[major]} or newer" in guide
