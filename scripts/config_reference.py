"""Writes config/README.md, the config reference, from src/eagle3prep/config/schema.yaml (the one source of every key).

    python scripts/config_reference.py            # rewrite config/README.md
    python scripts/config_reference.py --check    # exit 1 when config/README.md is not what the schema gives

tests/test_docs.py runs --check's comparison, so a schema edit without a rerun of this script fails the tests.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "src" / "eagle3prep" / "config" / "schema.yaml"  # package data: the one schema
OUT = REPO / "config" / "README.md"

HEADER = """\
# Configuration reference

Generated from `src/eagle3prep/config/schema.yaml` by `scripts/config_reference.py`; do not edit by hand (the tests check
that it is current: run `python scripts/config_reference.py` after a schema change).

A config you pass with `--configfile` is your whole config over the schema's defaults: every key below that
you leave out takes the default given here. `config/config.yaml` is the embedded demo's config;
`config/examples/` has a Llama-3.1-8B and a Kimi-K2.5 config to start from. One value for one run:
`--config 'section={key: value}'` (a whole section as YAML flow; see docs/guides/real-model.md).
"""


def _code(value) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return f"`{text.removesuffix('...').strip()}`"


def _type(spec: dict) -> str:
    if "oneOf" in spec or "anyOf" in spec:
        return " or ".join(_type(s) for s in spec.get("oneOf", spec.get("anyOf")))
    if "enum" in spec:
        return " \\| ".join(_code(v) for v in spec["enum"])
    kind = spec.get("type", "any")
    if "$ref" in spec and spec["$ref"].endswith("json_value"):
        kind = "JSON value"
    kinds = kind if isinstance(kind, list) else [kind]
    text = " or ".join(kinds)
    if kind == "array" and "items" in spec:
        text = f"list of {_type(spec['items'])}"
    if kind == "object":
        text = "mapping"
    bounds = [
        f"{op} {spec[key]}"
        for key, op in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<"))
        if key in spec
    ]
    if "minItems" in spec:
        bounds.append(f"at least {spec['minItems']} item" + ("s" if spec["minItems"] != 1 else ""))
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _rows(prefix: str, spec: dict, required: set[str]):
    """One row per leaf key; a nested section with properties of its own gives rows for each of them."""
    for name, sub in spec.get("properties", {}).items():
        key = f"{prefix}.{name}" if prefix else name
        if sub.get("type") == "object" and "properties" in sub:
            yield from _rows(key, sub, set(sub.get("required", [])))
            continue
        default = "**required**" if name in required else (_code(sub["default"]) if "default" in sub else "")
        yield f"| `{key}` | {_cell(_type(sub))} | {default} | {_cell(sub.get('description', ''))} |"


def render(schema: dict) -> str:
    parts = [HEADER]
    top_required = set(schema.get("required", []))
    for section, spec in schema["properties"].items():
        if spec.get("type") != "object":  # a top-level key of its own (replace_results): a one-row table
            parts.append(f"\n## `{section}`\n\n| key | type | default | what it does |\n|---|---|---|---|\n")
            parts.append(
                f"| `{section}` | {_cell(_type(spec))} | {_code(spec['default'])} | {_cell(spec['description'])} |\n"
            )
            continue
        need = " (the section is required)" if section in top_required else ""
        parts.append(f"\n## `{section}`{need}\n")
        if spec.get("description"):
            parts.append(f"\n{_cell(spec['description'])}\n")
        parts.append("\n| key | type | default | what it does |\n|---|---|---|---|\n")
        parts.append("".join(f"{row}\n" for row in _rows(section, spec, set(spec.get("required", [])))))
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if config/README.md is out of date")
    args = parser.parse_args(argv)
    text = render(yaml.safe_load(SCHEMA.read_text(encoding="utf-8")))
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(REPO)} is out of date: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
