"""One line per job for a user's error and for Ctrl-C (eagle3prep.errors.one_line_errors)."""

import dataclasses

import pytest

from eagle3prep.errors import UserError, one_line_errors
from eagle3prep.settings import ExtractSettings

from testkit.shards import capture_spec, with_settings


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


def test_sigterm_is_one_line_and_exit_143(capsys):
    """A preemption (Slurm sends SIGTERM first) unwinds the job like Ctrl-C: the engine is stopped by the
    `with` blocks on the way out and no half output is sealed; the handler is the caller's again after."""
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e, one_line_errors():
        os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.code == 143
    err = capsys.readouterr().err
    assert err.startswith("error: stopped by SIGTERM") and err.count("\n") == 1 and "same command" in err
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT"])
def test_full_disk_is_one_line_naming_the_file(capsys, code):
    import errno
    import os

    n = getattr(errno, code)
    with pytest.raises(SystemExit) as e, one_line_errors():
        raise OSError(n, os.strerror(n), "results/hidden_states/shard_1/layer_4.safetensors.tmp")
    assert e.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "layer_4.safetensors.tmp" in last and "finished shards are kept" in last


def test_other_os_errors_keep_their_traceback():
    import errno

    with pytest.raises(OSError), one_line_errors():
        raise OSError(errno.EIO, "I/O error")


def test_ctrl_c_in_an_extract_job_leaves_no_empty_shard_folder(tmp_path, monkeypatch):
    """Issue #27 item 7: Ctrl-C left an empty results/hidden_states/shard_0/ (healed by the rerun, but it looked
    like a shard)."""
    import eagle3prep.extract.stage as extract

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 8, "hidden_size": 16}')
    spec = capture_spec("hf", str(model), [2, 8], dtype="bfloat16", device="cpu", tp_size=1, max_seq_len=2048)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # as in a model load or a batch: after the job made its folder

    monkeypatch.setattr(extract, "index_of_tokenized", interrupted)
    out = tmp_path / "hidden_states" / "shard_0"
    with pytest.raises(KeyboardInterrupt):
        extract.extract_shard(
            "tokens.jsonl", str(out), with_settings(spec, ExtractSettings.defaults(batch_tokens=1024)), shard=0
        )
    assert not out.exists() and out.parent.is_dir()
    # Another failure keeps what the job wrote, for study (Snakemake removes a failed job's outputs itself).
    monkeypatch.setattr(extract, "index_of_tokenized", lambda *a: (_ for _ in ()).throw(OSError("disk")))
    with pytest.raises(OSError, match="disk"):
        extract.extract_shard(
            "tokens.jsonl", str(out), with_settings(spec, ExtractSettings.defaults(batch_tokens=1024)), shard=0
        )
    assert out.is_dir()


def test_a_rerun_removes_what_the_earlier_built_in_path_staged_before_the_engine_starts(tmp_path, monkeypatch):
    """A shard killed under the earlier built-in path left <shard>/.vllm-staging with request files; nothing
    writes there now, so the rerun's job removes it before it starts the engine."""
    from eagle3prep.extract import stage as extract
    from eagle3prep.model_facts import ModelFacts

    from testkit.shards import DEMO_LAYER_IDS, write_tokenized

    shard = tmp_path / "shard_0"
    (shard / ".vllm-staging").mkdir(parents=True)
    (shard / ".vllm-staging" / "e3p-1-0-3.safetensors").write_bytes(b"x")
    tokens = write_tokenized(tmp_path / "tokens.jsonl", [5, 7], seed=0)
    facts = ModelFacts(8, 16, 100, ["LlamaForCausalLM"], 1024, "llama")
    seen = []

    def make_backend(spec):
        seen.append(sorted(p.name for p in shard.iterdir()))
        raise RuntimeError("no engine here")

    monkeypatch.setattr(extract, "make_backend", make_backend)
    spec = capture_spec(
        backend="vllm",
        model_path=str(tmp_path),
        layer_ids=DEMO_LAYER_IDS,
        tp_size=0,
        dtype="bfloat16",
        device="cpu",
        max_seq_len=2048,
    )
    with pytest.raises(RuntimeError, match="no engine here"):
        spec = dataclasses.replace(with_settings(spec, ExtractSettings.defaults()), facts=facts)  # no config.json here
        extract.extract_shard(str(tokens), str(shard), spec, 0)
    assert seen == [[]]


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("Device string must not be empty"),  # vLLM 0.26 (CUDA build), no GPU: torch.device("")
        RuntimeError("Failed to infer device type"),  # older vLLM's DeviceConfig, the same host
    ],
)
@pytest.mark.parametrize("section", ["extract", "regenerate"])
def test_vllm_on_a_host_without_a_gpu_says_so_in_one_line(exc, section):
    """It read "vLLM 0.26.0 could not start ...: Device string must not be empty; the engine's traceback is in the
    log above", with no traceback there: the driver raised it before any child started."""
    from eagle3prep.vllm.engine.errors import engine_error

    err = engine_error(exc, "", version="0.26.0", arch="LlamaForCausalLM", path="hooks", section=section)
    text = str(err)
    assert "\n" not in text and "traceback" not in text
    assert "vLLM 0.26.0 finds no usable GPU on this host" in text
    assert str(exc) in text  # what vLLM said, for a search
    assert err.any_path  # the other capture path would fail the same way: no second engine start
    if section == "extract":
        assert "extract.backend: hf" in text
