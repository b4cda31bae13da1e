"""The docs as a user reads them (issue #27 item 9): a short README that says the commands CI and a GPU host
run, the rest in docs/guides/ by task, a config reference generated from the schema, and no link or cited
path that leads nowhere."""

import importlib.util
import re

from workflow_helpers import REPO

GUIDES = ("real-model", "reruns", "storage", "training", "regeneration", "cluster", "validation")
DOCS = [REPO / "README.md", REPO / "config" / "README.md", *sorted((REPO / "docs" / "guides").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path in backticks under one of the repository's own folders, e.g. `bench/fp8_error.py` or `docs/runs/fp8/`.
CITED = re.compile(r"`((?:docs|bench|scripts|tests|src|rules|envs|config|profiles|resources|\.ci)/[\w./-]*)`")


def _config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_short_and_gives_the_commands_that_ci_and_a_gpu_host_run():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 8 * 1024, len(readme.encode())
    assert "make test" in (REPO / ".ci" / "run").read_text(encoding="utf-8")  # CI runs the README's command
    make = (REPO / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test", "gpu-env"):
        assert re.search(rf"^{target}:", make, re.M), f"Makefile has no {target} target"
        assert f"make {target}" in readme, f"the README does not give `make {target}`"
    assert "--configfile" in readme and "your whole config over the schema's defaults" in readme


def test_the_guides_exist_and_the_readme_links_each():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for name in GUIDES:
        assert (REPO / "docs" / "guides" / f"{name}.md").is_file(), name
        assert f"(docs/guides/{name}.md)" in readme, name
    assert "(config/README.md)" in readme


def test_every_link_and_cited_path_in_the_readme_and_guides_exists():
    broken = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor in the same page
            if not (doc.parent / target.split("#")[0]).resolve().exists():
                broken.append(f"{doc.relative_to(REPO)}: ({target})")
        for path in CITED.findall(text):
            # config/my-run.yaml is the file the guides tell the user to make
            if not path.startswith("config/my-run") and not (REPO / path.rstrip(".")).exists():
                broken.append(f"{doc.relative_to(REPO)}: `{path}`")
    assert not broken, broken


def test_config_reference_is_generated_from_the_current_schema():
    module = _config_reference()
    import yaml

    expected = module.render(yaml.safe_load((REPO / "config" / "schema.yaml").read_text(encoding="utf-8")))
    assert (REPO / "config" / "README.md").read_text(encoding="utf-8") == expected, (
        "config/README.md is out of date: run python scripts/config_reference.py"
    )


def test_config_reference_lists_every_key_of_the_schema():
    import yaml

    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text(encoding="utf-8"))
    reference = (REPO / "config" / "README.md").read_text(encoding="utf-8")

    def keys(prefix, spec):
        for name, sub in spec.get("properties", {}).items():
            key = f"{prefix}.{name}" if prefix else name
            yield from keys(key, sub) if "properties" in sub else [key]

    missing = [k for k in keys("", schema) if f"| `{k}` |" not in reference]
    assert not missing, missing
