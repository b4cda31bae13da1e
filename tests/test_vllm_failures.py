"""Known vLLM engine bugs and failed engine starts, on real vllm-cpu (DESIGN.md §5).

Runs in .venv-vllm only. Four engine starts in all: tiny DeepSeek-V3 with and without the CPU
rotary workaround (vllm/engine/workarounds.KNOWN_BUGS), the built-in path on a tiny Qwen2-MoE, which vLLM
refuses in a child process: the job's last line must carry that child's root cause, and the tiny Kimi
INT4 target, whose experts have no vllm-cpu kernel without AMX. On a CPU with AMX, fp32 MLA needs vllm-cpu's reference
CPU_MLA attention (workarounds.cpu_mla_fp32_kwargs).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (default 4)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from eagle3prep.errors import one_line_errors  # noqa: E402
from eagle3prep.settings import ExtractSettings  # noqa: E402
from eagle3prep.vllm.capture import backend as vllm_backend  # noqa: E402
from eagle3prep.vllm.engine import workarounds  # noqa: E402

from testkit.shards import capture_rows, capture_spec, with_settings  # noqa: E402
from testkit.tiny_models import NUM_LAYERS, build_family  # noqa: E402

# 1 and 3: after layers whose MLA applies the rotary; N: the pre-norm final state. No id 0, so either path can
# capture them: auto (hooks first) with the workaround, the built-in path without it.
LAYER_IDS = [1, 3, NUM_LAYERS]
ROWS = [[(5 + 7 * i) % 400 + 3 for i in range(40)], [(11 + 13 * i) % 400 + 3 for i in range(9)]]
MAX_SEQ_LEN = 64


def make_backend(model_path, capture_path, staging):
    spec = capture_spec(
        backend="vllm",
        model_path=str(model_path),
        layer_ids=LAYER_IDS,
        dtype="float32",
        max_seq_len=MAX_SEQ_LEN,
        device="cpu",
        tp_size=1,
    )
    settings = ExtractSettings.defaults(capture_path=capture_path, enforce_eager=True, staging_dir=str(staging))
    return vllm_backend.VLLMBackend(with_settings(spec, settings))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return build_family("deepseek_v3", tmp_path_factory.mktemp("models") / "deepseek_v3")


@pytest.fixture(scope="module")
def reference(deepseek):
    """{layer_id: [sum_T, H]} from transformers fp32, one row at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(deepseek, dtype=torch.float32).eval()
    final = {}
    model.model.norm.register_forward_pre_hook(lambda mod, args: final.__setitem__("x", args[0]))
    out = {i: [] for i in LAYER_IDS}
    with torch.inference_mode():
        for row in ROWS:
            hs = model(torch.tensor([row]), output_hidden_states=True, use_cache=False).hidden_states
            for i in LAYER_IDS:
                out[i].append((final["x"] if i == NUM_LAYERS else hs[i])[0])
    return {i: torch.cat(v) for i, v in out.items()}


def run_probe(model_path, tmp_path_factory, *, no_workarounds, work=None, capture_path="auto"):
    """Probe (and run `work` on) an engine; returns its info, work's result and the backend's log lines."""
    lines = []
    with pytest.MonkeyPatch.context() as mp:
        if no_workarounds:
            mp.setenv(workarounds.NO_WORKAROUNDS_ENV, "1")
        else:
            mp.delenv(workarounds.NO_WORKAROUNDS_ENV, raising=False)
        mp.setattr(vllm_backend, "log", lines.append)
        backend = make_backend(model_path, capture_path, tmp_path_factory.mktemp("staging"))
        try:
            info = backend.probe()
            result = work(backend, info) if work else capture_rows(backend, ROWS)
        finally:
            backend.close()
    return info, result, lines


@pytest.fixture(scope="module")
def with_workaround(deepseek, tmp_path_factory):
    """A whole shard through extract_shard: the layer files and the manifest."""
    from safetensors.torch import load_file

    from eagle3prep.extract import extract_shard

    out_dir = tmp_path_factory.mktemp("shard") / "out"
    tokenized = out_dir.parent / "shard_0.jsonl"
    tokenized.write_text(
        "".join(
            json.dumps({"row": i, "id": str(i), "input_ids": r, "loss_mask": [1] * len(r), "seq_len": len(r)}) + "\n"
            for i, r in enumerate(ROWS)
        )
    )

    def work(backend, info):
        manifest = extract_shard(
            str(tokenized),
            str(out_dir),
            with_settings(
                backend.spec,
                dataclasses.replace(
                    backend.settings, speed=dataclasses.replace(backend.settings.speed, batch_tokens=256)
                ),
            ),
            0,
            engine=(backend, info),
        )
        layers = {i: load_file(out_dir / f"layer_{i}.safetensors")["hidden_states"] for i in LAYER_IDS}
        return manifest, layers

    return run_probe(deepseek, tmp_path_factory, no_workarounds=False, work=work)


def rel_errors(out, ref):
    return {i: float((out[i].float() - ref[i]).norm() / ref[i].norm()) for i in LAYER_IDS}


def test_deepseek_on_cpu_gets_the_native_rotary_and_matches_transformers(with_workaround, reference):
    info, (manifest, layers), lines = with_workaround
    assert info.capture_path == "hooks"  # auto's first choice on DeepSeek too (docs/DESIGN.md §5)
    assert manifest.engine["workarounds"] == ["cpu-mla-native-rotary"]  # validation can tell later
    assert [x for x in lines if "workaround cpu-mla-native-rotary applied" in x and "forward_cpu" in x]
    errs = rel_errors(layers, reference)
    print("deepseek_v3 with the workaround, relative error per layer id:", errs)
    assert all(e < 1e-5 for e in errs.values()), errs


def test_deepseek_without_the_workaround_is_captured_wrong(deepseek, tmp_path_factory, reference):
    """EAGLE3PREP_NO_WORKAROUNDS=1 starts the broken engine: the bug is real, and the switch works (on the
    built-in path, so that path runs DeepSeek's MLA on vllm-cpu too; the bug is the rotary kernel's)."""
    info, out, lines = run_probe(deepseek, tmp_path_factory, no_workarounds=True, capture_path="builtin")
    assert info.capture_path == "builtin"
    assert info.details["workarounds"] == []
    assert [x for x in lines if "cpu-mla-native-rotary not applied; the capture is expected to be wrong" in x]
    errs = rel_errors(out, reference)
    print("deepseek_v3 without the workaround, relative error per layer id:", errs)
    assert max(errs.values()) > 0.1, errs


def test_builtin_path_on_qwen2_moe_is_refused_in_one_line_before_the_engine_starts(tmp_path, capfd):
    """vllm-cpu 0.32's Qwen2MoeForCausalLM has no SupportsEagle3, which vLLM's model registry tells without an
    engine (vLLM would refuse it at engine start, "Model does not support EAGLE3 interface"); the hooks take it."""
    model = build_family("qwen2_moe", tmp_path / "qwen2_moe")
    backend = make_backend(model, "builtin", tmp_path / "staging")
    backend._start = lambda *args: pytest.fail("the engine was started")
    with pytest.raises(SystemExit), one_line_errors():  # one_line_errors exits on a UserError only
        backend.probe()
    lines = capfd.readouterr().err.strip().splitlines()
    print(lines[-1])
    assert lines[-1].startswith("error: extract.capture_path = builtin: vLLM "), lines[-1]
    assert "has no SupportsEagle3 (its EAGLE-3 interface) for Qwen2MoeForCausalLM" in lines[-1]
    assert lines[-1].endswith("use extract.capture_path: hooks (or auto) or extract.backend: hf")


def test_kimi_int4_on_cpu_runs_or_is_refused_in_one_line(tmp_path, capfd):
    """The seed's target family on vllm-cpu: its INT4 routed experts need AMX (vLLM's CPUExpertsInt4). Without
    it the engine start fails in a worker; the job's last line must say why and what to do, after one
    engine start (the built-in path loads the same experts, so auto does not try it)."""
    from testkit.tiny_kimi import build_tiny_kimi

    model = build_tiny_kimi(tmp_path / "kimi_int4", "int4")
    spec = capture_spec(
        backend="vllm",
        model_path=str(model),
        layer_ids=[3, 5, 8],
        dtype="bfloat16",
        max_seq_len=64,
        device="cpu",
        tp_size=1,
    )
    backend = vllm_backend.VLLMBackend(
        with_settings(
            spec, ExtractSettings.defaults(capture_path="auto", enforce_eager=True, staging_dir=str(tmp_path))
        )
    )
    lines = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_backend, "log", lines.append)
        try:
            with one_line_errors():
                info = backend.probe()
        except SystemExit:
            err = capfd.readouterr().err.strip().splitlines()[-1]
            print(err)
            assert err.startswith("error: vLLM ") and "could not start DeepseekV3ForCausalLM" in err
            assert "No WNA16 MoE backend supports" in err and "run extract on a GPU" in err
            assert not [x for x in lines if "trying builtin" in x]
            return
        try:  # a CPU with AMX: the engine runs it, and the capture must be finite and right-shaped
            out = capture_rows(backend, ROWS)
        finally:
            backend.close()
    assert info.hidden_size == 512 and set(out) == {3, 5, 8}
    assert all(bool(torch.isfinite(t.float()).all()) and t.shape == (sum(map(len, ROWS)), 512) for t in out.values())


def test_fp32_mla_on_vllm_cpu_takes_the_reference_mla_backend():
    """vllm-cpu prefers AMX_MLA on a CPU with AMX, which takes no fp32 weights: fp32 MLA models ask for CPU_MLA
    (the fp32 DeepSeek captures above start on an AMX host only with it); other dtypes and models ask for nothing."""
    deepseek = ["DeepseekV3ForCausalLM"]
    assert workarounds.cpu_mla_fp32_kwargs(True, deepseek, "float32") == {"attention_backend": "CPU_MLA"}
    assert workarounds.cpu_mla_fp32_kwargs(True, deepseek, "bfloat16") == {}
    assert workarounds.cpu_mla_fp32_kwargs(True, ["LlamaForCausalLM"], "float32") == {}
    assert workarounds.cpu_mla_fp32_kwargs(False, deepseek, "float32") == {}  # a GPU has no such preference
    fixes = workarounds.engine_workarounds(vllm.__version__, True, deepseek, disabled=True, dtype="float32")
    assert fixes.engine_kwargs == {"attention_backend": "CPU_MLA"} and fixes.names == []  # applied either way


def test_an_engine_that_dies_mid_shard_says_why_in_one_line(tmp_path, capfd, monkeypatch):
    """An exception inside vLLM's engine core mid-shard (planted at the hooks' step start, in the engine core's own
    process): the job's one error line carries that exception, the shard and the setting to change, never vLLM's
    "See stack trace (above)"."""
    from eagle3prep.extract import extract_shard

    from testkit.shards import write_tokenized

    model = build_family("llama", tmp_path / "llama")
    tokenized = write_tokenized(tmp_path / "shard_3.jsonl", [24, 30, 17], seed=0)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine core in a process of its own
    monkeypatch.setenv("EAGLE3PREP_KILL_AT", "vllm.engine_step:rows=3")  # the shard's, not the probe's smoke shard
    monkeypatch.setenv("EAGLE3PREP_KILL_SCOPE", "raise")
    backend = make_backend(model, "hooks", tmp_path / "staging")
    with pytest.raises(SystemExit), one_line_errors():
        extract_shard(str(tokenized), str(tmp_path / "out"), backend.spec, shard=3)
    last = capfd.readouterr().err.strip().splitlines()[-1]
    print(last)
    assert last.startswith("error: shard 3: vLLM ") and "died capturing (hooks path)" in last, last
    assert "PlantedError: planted fault at vllm.engine_step" in last and "stack trace" not in last, last
