"""Which capture path of the installed vLLM takes a model family (its interface asked by vllm/families.py, the
refusal in capture/choice.py), and the parse-time check that refuses a family no path takes
(families.check_capture_path). Runs without vLLM: its model registry is faked,
and so is the installed version; the contract test checks the registry names against real vLLM sources."""

from __future__ import annotations

import json
import sys
from types import ModuleType, SimpleNamespace

import pytest

from eagle3prep.config import ConfigError
from eagle3prep.vllm import families, registry
from eagle3prep.vllm.capture import choice
from eagle3prep.vllm.engine.errors import engine_error
from eagle3prep.vllm.families import check_capture_path

QWEN2_MOE = "Qwen2MoeForCausalLM"  # no SupportsEagle3 in any checked vLLM
# vLLM's worker at engine start, when the built-in path asks a class without the interface for aux hidden states
NO_EAGLE3 = (
    "Traceback (most recent call last):\n"
    '  File "vllm/v1/worker/gpu/model_runner.py", line 1, in load_model\n'
    "RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested\n"
)


def test_a_family_without_eagle3_on_vllm_0_34_has_no_path_and_the_line_names_what_captures_it():
    line = choice.refusal("0.34.0", QWEN2_MOE, "auto", supports=False)
    assert line == (
        "extract.backend = vllm: no capture path of vLLM 0.34.0 takes Qwen2MoeForCausalLM: vLLM 0.34.0 has no "
        "SupportsEagle3 (its EAGLE-3 interface) for Qwen2MoeForCausalLM, which the built-in path needs, and its "
        "hooks path is gone (no V1 model runner since 0.34.0); use a vLLM from 0.16.0 to before 0.34.0 with "
        "extract.capture_path: hooks or extract.backend: hf"
    )
    for wanted in ("builtin", "hooks"):  # every setting is refused, and no line names a path 0.34 refuses
        line = choice.refusal("0.34.0", QWEN2_MOE, wanted, supports=False)
        assert "extract.capture_path: builtin" not in line and "(or auto)" not in line, line
        assert line.endswith("with extract.capture_path: hooks or extract.backend: hf"), line


def test_a_family_without_eagle3_before_0_34_is_refused_only_on_the_built_in_path():
    assert choice.refusal("0.32.0", QWEN2_MOE, "auto", supports=False) is None  # auto takes the hooks
    assert choice.refusal("0.32.0", QWEN2_MOE, "hooks", supports=False) is None
    line = choice.refusal("0.32.0", QWEN2_MOE, "builtin", supports=False)
    assert line.startswith("extract.capture_path = builtin: vLLM 0.32.0 has no SupportsEagle3"), line
    assert line.endswith("use extract.capture_path: hooks (or auto) or extract.backend: hf"), line


@pytest.mark.parametrize("supports", [True, None])
def test_a_family_with_eagle3_or_unknown_is_not_refused(supports):
    for version in ("0.26.0", "0.32.0", "0.34.0"):
        for wanted in ("auto", "builtin"):
            assert choice.refusal(version, "LlamaForCausalLM", wanted, supports) is None


def test_hooks_on_vllm_0_34_name_the_built_in_path_only_where_it_takes_the_model():
    line = choice.refusal("0.34.0", "LlamaForCausalLM", "hooks", supports=True)
    assert line.startswith("extract.capture_path = hooks: vLLM 0.34.0 has no GPUModelRunner."), line
    assert "set extract.capture_path: builtin" in line
    line = choice.refusal("0.34.0", QWEN2_MOE, "hooks", supports=False)
    assert "capture_path: builtin" not in line and line.endswith("extract.backend: hf"), line


def test_a_later_vllm_with_the_interface_is_named_where_the_registry_knows_one():
    """DeepSeek-V3's class has SupportsEagle3 from the checked 0.26 on: an older vLLM's refusal names it."""
    line = choice.refusal("0.20.0", "DeepseekV3ForCausalLM", "builtin", supports=False)
    assert line.endswith("use vLLM 0.26.0 or later (the built-in path), extract.capture_path: hooks (or auto) or "
                         "extract.backend: hf"), line  # fmt: skip


def fake_vllm(monkeypatch, classes: dict[str, type | None]) -> None:
    """vLLM's model registry as 0.34 exposes it: ModelRegistry._try_load_model_cls and interfaces.supports_eagle3."""
    models = ModuleType("vllm.model_executor.models")
    models.ModelRegistry = SimpleNamespace(_try_load_model_cls=classes.get)
    interfaces = ModuleType("vllm.model_executor.models.interfaces")
    interfaces.supports_eagle3 = lambda cls: getattr(cls, "supports_eagle3", False)
    for name, module in (
        ("vllm", ModuleType("vllm")),
        ("vllm.model_executor", ModuleType("vllm.model_executor")),
        ("vllm.model_executor.models", models),
        ("vllm.model_executor.models.interfaces", interfaces),
    ):
        monkeypatch.setitem(sys.modules, name, module)


def test_support_is_asked_of_the_installed_vllms_model_registry(monkeypatch):
    eagle3 = type("LlamaForCausalLM", (), {"supports_eagle3": True})
    fake_vllm(monkeypatch, {"LlamaForCausalLM": eagle3, QWEN2_MOE: type(QWEN2_MOE, (), {})})
    assert families.supports_eagle3("LlamaForCausalLM") is True
    assert families.supports_eagle3(QWEN2_MOE) is False
    assert families.supports_eagle3("MyOwnForCausalLM") is None  # no class of vLLM's own: the engine start decides


def test_support_is_unknown_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # the import fails, even where a vLLM is installed
    assert families.supports_eagle3("LlamaForCausalLM") is None


def model_folder(tmp_path, arch):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "num_hidden_layers": 4}))
    return tmp_path


def test_parse_time_check_refuses_in_one_line_and_asks_vllm_once_per_version(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(registry, "installed_version", lambda: "0.34.0")
    monkeypatch.setattr(families, "_ask_child", lambda arch: asked.append(arch) or {"supports": False})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    model = model_folder(tmp_path / "m", QWEN2_MOE)
    for _ in range(2):
        with pytest.raises(ConfigError) as err:
            check_capture_path("vllm", "auto", model)
        line = str(err.value)
        assert line.startswith("config error: extract.backend = vllm: no capture path of vLLM 0.34.0 takes"), line
        assert "\n" not in line
    assert asked == [QWEN2_MOE]  # the second parse read the stamp
    assert json.loads((tmp_path / families.STAMP).read_text()) == {f"0.34.0 {QWEN2_MOE}": False}
    check_capture_path("hf", "auto", model)  # the hf backend needs no vLLM path


def test_parse_time_check_passes_where_vllm_is_not_installed_here(tmp_path, monkeypatch):
    def no_vllm():
        raise ImportError("vLLM is not installed")

    monkeypatch.setattr(registry, "installed_version", no_vllm)
    monkeypatch.setattr(families, "_ask_child", lambda arch: pytest.fail("no vLLM to ask"))
    assert families.installed_support(QWEN2_MOE, stamp=None) is None
    check_capture_path("vllm", "builtin", model_folder(tmp_path, QWEN2_MOE))


def test_the_child_answers_in_its_own_line(tmp_path, monkeypatch):
    """The real child process, in an environment without vLLM: it cannot tell, and says so without failing."""
    monkeypatch.setattr(registry, "installed_version", lambda: "0.32.0")
    assert families.installed_support("LlamaForCausalLM", stamp=tmp_path / "stamp.json") == ("0.32.0", None)
    assert json.loads((tmp_path / "stamp.json").read_text()) == {"0.32.0 LlamaForCausalLM": None}


@pytest.mark.parametrize(("version", "fix"), [
    ("0.34.0", "use a vLLM from 0.16.0 to before 0.34.0 with extract.capture_path: hooks or extract.backend: hf"),
    ("0.32.0", "use extract.capture_path: hooks (or auto) or extract.backend: hf"),
])  # fmt: skip
def test_the_engine_start_refusal_names_no_path_the_installed_vllm_refuses(version, fix):
    """The driver hands engine_error the built-in path's fix (choice.other_ways), as VLLMBackend._start_first."""
    err = engine_error(RuntimeError("see root cause above"), NO_EAGLE3, version=version, arch=QWEN2_MOE,
                       path="builtin", wanted="builtin", builtin_fix=f"use {choice.other_ways(version, QWEN2_MOE)}")  # fmt: skip
    line = str(err)
    assert line.startswith(f"vLLM {version} could not start {QWEN2_MOE} with capture_path builtin: "), line
    assert "does not support EAGLE3" in line and line.endswith(fix), line
