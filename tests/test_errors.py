"""One line per job for a user's error and for Ctrl-C (eagle3prep.errors.one_line_errors)."""

import pytest

from eagle3prep.errors import UserError, one_line_errors
from eagle3prep.settings import ExtractSettings


def test_user_error_is_one_line_and_exit_1(capsys):
    with pytest.raises(SystemExit) as e, one_line_errors():
        raise UserError("data.sources: 'x' does not exist")
    assert e.value.code == 1 and capsys.readouterr().err == "error: data.sources: 'x' does not exist\n"


def test_ctrl_c_is_one_line_not_a_traceback(capsys):
    # Was a KeyboardInterrupt traceback per running job (~100 lines with torch's frames).
    with pytest.raises(SystemExit) as e, one_line_errors():
        raise KeyboardInterrupt
    assert e.value.code == 130
    assert capsys.readouterr().err == (
        "interrupted (Ctrl-C): this job's outputs are incomplete; the same command redoes it\n"
    )


def test_ctrl_c_in_an_extract_job_leaves_no_empty_shard_folder(tmp_path, monkeypatch):
    """Issue #27 item 7: Ctrl-C left an empty results/hidden_states/shard_0/ (healed by the rerun, but it looked
    like a shard)."""
    import eagle3prep.extract as extract
    from eagle3prep.backends.base import CaptureSpec

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 8, "hidden_size": 16}')
    spec = CaptureSpec("hf", str(model), [2, 8], dtype="bfloat16")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # as in a model load or a batch: after the job made its folder

    monkeypatch.setattr(extract, "index_of_tokenized", interrupted)
    out = tmp_path / "hidden_states" / "shard_0"
    with pytest.raises(KeyboardInterrupt):
        extract.extract_shard("tokens.jsonl", str(out), spec, ExtractSettings.defaults(batch_tokens=1024), shard=0)
    assert not out.exists() and out.parent.is_dir()
    # Another failure keeps what the job wrote, for study (Snakemake removes a failed job's outputs itself).
    monkeypatch.setattr(extract, "index_of_tokenized", lambda *a: (_ for _ in ()).throw(OSError("disk")))
    with pytest.raises(OSError, match="disk"):
        extract.extract_shard("tokens.jsonl", str(out), spec, ExtractSettings.defaults(batch_tokens=1024), shard=0)
    assert out.is_dir()
