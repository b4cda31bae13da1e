"""The quality bench's verdict on the peer's files (testkit.peer_files).

The peer (speculators' generate-offline-data) writes one `hs_{row}.safetensors` per row in the layout
our export's `copy` mode writes, so a finished demo run's export stands in for it here.
"""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file
from test_export import finished_results

from testkit import peer_files as peer


@pytest.fixture
def out(tmp_path, tmp_path_factory, demo_model_dir):
    """OUT as the bench lays it out: ours' results, the peer's export, the target."""
    res = finished_results(tmp_path_factory, demo_model_dir)
    (tmp_path / "wd/ours").mkdir(parents=True)
    (tmp_path / "wd/ours/results").symlink_to(res)
    files = tmp_path / "wd/peer/results/export/speculators/hidden_states"
    shutil.copytree(res / "export/speculators/hidden_states", files)
    (tmp_path / "target").mkdir()
    (tmp_path / "target/model").symlink_to(demo_model_dir)
    return tmp_path


def test_the_peers_files_rebuild_ours_byte_for_byte_and_pass(out):
    assert peer.peer_verdict(out, "cpu") == {"shard_0": "PASS", "shard_1": "PASS"}
    for source in sorted((out / "wd/ours/results/hidden_states").glob("shard_*")):
        rebuilt = out / "wd/peer/results/hidden_states" / source.name
        for f in source.glob("layer_*.safetensors"):
            assert (rebuilt / f.name).read_bytes() == f.read_bytes()


def test_the_peers_layers_in_another_order_fail(out):
    # What a peer that stacks its layers in another order than the ids it was given would write.
    for f in (out / "wd/peer/results/export/speculators/hidden_states").glob("hs_*.safetensors"):
        t = load_file(str(f))
        save_file({"token_ids": t["token_ids"], "hidden_states": t["hidden_states"].flip(1).contiguous()}, str(f))
    verdicts = peer.peer_verdict(out, "cpu")
    assert all(v.startswith("FAIL") for v in verdicts.values()), verdicts


def test_other_token_ids_stop_with_the_row(out):
    f = out / "wd/peer/results/export/speculators/hidden_states/hs_0.safetensors"
    t = load_file(str(f))
    save_file({"token_ids": t["token_ids"] + 1, "hidden_states": t["hidden_states"]}, str(f))
    with pytest.raises(SystemExit, match="hs_0.safetensors holds other token ids than ours' row 0"):
        peer.peer_verdict(out, "cpu")


def test_a_missing_file_stops_with_the_row(out):
    (out / "wd/peer/results/export/speculators/hidden_states/hs_1.safetensors").unlink()
    with pytest.raises(
        SystemExit, match="hs_1.safetensors is missing: the peer wrote no hidden states for ours' row 1"
    ):
        peer.peer_verdict(out, "cpu")
