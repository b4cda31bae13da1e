"""The schema (src/eagle3prep/config/schema.yaml) holds every default of a config key, and the code (the package and scripts/) no second one:
a parameter, a field or a `.get(key, default)` named like a schema key either has no default, or takes it from
the schema with `schema_default(section, key)`. Names that mean something else than the config key are listed
with why."""

import ast

import yaml

from eagle3prep.config import SCHEMA

from testkit.workflow import REPO

PACKAGE = REPO / "src" / "eagle3prep"
# The tiny models, planted mistakes and test-only writers choose their own values (seeds, storage): they are
# fixtures, not a stage reading the config.
FIXTURES = PACKAGE / "testing"
# Named like a schema key, meaning something else: "file:function_or_class:name" -> what it is.
NOT_CONFIG = {
    "demo.py:build_model:seed": "the demo model's weights' seed",
    "extract/stage.py:extract_shard:threads": "the job's Snakemake threads; None leaves torch's own",
    "layers.py:check_layer_ids:convention": "the ids' convention, by default the package's own (layers.CONVENTION)",
    "shard/shardset.py:speculators_layer_error:convention": "the ids' convention, by default the package's own",
    "demo.py:build_demo_model:seed": "the demo model's weights' seed",
    "overfit_gate/stage.py:GateSettings:max_tokens": "the gate's reply length, not regenerate.sampling.max_tokens",
    "overfit_gate/train.py:epochs_for:seed": "speculators' batch sampler's seed",
    "made_by.py:read_record:path": "the record file, not model.path",
    "made_by.py:write_record:path": "the record file, not model.path",
    "made_by.py:finished_shards:hidden_states": "the hidden-state folder, not export.hidden_states",
    "made_by.py:check:hidden_states": "the hidden-state folder, not export.hidden_states",
    "run/parse.py:finished_layer_ids:hidden_states": "the hidden-state folder, not export.hidden_states",
    "run/parse.py:drafts_notes:hidden_states": "the hidden-state folder, not export.hidden_states",
    "config/model.py:model_layer_ids:drafts": "no drafts: the ids alone (callers with a config pass layers.drafts)",
    "settings.py:LayersSettings:drafts": "an empty list, the schema's default, as a field's factory",
    "validate/stage.py:validate_shard:keep_failed": "the failure line's wording; benches judging shards outside a "
    "workflow have no heal setting (run_validate_job passes heal.keep_failed)",
    "regenerate/review.py:sample_pairs:seed": "the review's sample seed",
    "regenerate/review.py:review:seed": "the review's sample seed",
    "regenerate/runner.py:_Conv:seed": "one conversation's seed, set from conversation_seed",
    "report/__init__.py:ReportPaths:overfit_gate": "the gate's report file, None without one",
    "report/data.py:funnel:max_seq_len": "a stats.json value shown as '?' when absent",
    "report/page.py:provenance_table:tp_size": "a manifest's engine record, older ones without it",
    "report/plots.py:distributions:max_seq_len": "the histogram's cap line, None to draw none",
    "report/samples.py:samples:max_seq_len": "the samples' cut mark, None to draw none",
    "shard/fp8.py:dequantize_fp8:dtype": "the dtype to read into, not extract.dtype",
    "shard/mxfp4.py:dequantize_mxfp4:dtype": "the dtype to read into, not extract.dtype",
    "shard/formats.py:decode:dtype": "the dtype to read into, not extract.dtype",
    "shard/readers.py:rows:dtype": "the dtype to read into, not extract.dtype",
    "shard/readers.py:read_layer:dtype": "the dtype to read into, not extract.dtype",
    "shard/manifest.py:ShardManifest:storage": "a manifest written before storage existed",
    "shard/sink.py:SinkSpec:logprob_rows": "the rows whose logprobs are kept, not their count",
    "shard/sink.py:SinkSpec:storage": "the schema's extract.storage as its format (schema_default inside)",
    "shard/writer.py:sink_spec:logprob_rows": "the rows whose logprobs are kept, not their count",
    "train/cpu.py:<lambda>:device": "torch's .to(device=None)",
    "validate/logits.py:logprobs_from_state:dtype": "the arithmetic's dtype, not extract.dtype",
    "validate/logits.py:judge_logprobs:dtype": "the capture's dtype given by the caller",
    "validate/reference.py:Reference:dtype": "the reference forward's dtype (float32), not extract.dtype",
    "verify.py:verify:threads": "verify's own reader threads, not extract.threads",
    "vllm/engine/workarounds.py:engine_workarounds:dtype": "None: the engine's own choice",
}

# Config values still defaulted in code, to be passed by every caller: index_of_tokenized's None stands for a
# backend that feeds no images, which bench/extractbench/phases.py relies on.
LEFT = {"shard/readers.py:index_of_tokenized:backend"}


def schema_keys():
    """{key: [section path]} of every leaf of config/schema.yaml."""
    keys = {}

    def walk(node, path):
        if props := node.get("properties"):
            for name, sub in props.items():
                walk(sub, [*path, name])
        else:
            keys.setdefault(path[-1], []).append(path[:-1])

    walk(yaml.safe_load(SCHEMA.read_text(encoding="utf-8")), [])
    return keys


def from_schema(default, name, sections) -> bool:
    """Whether `default` is schema_default("<section>", name) of a section that has the key."""
    return (
        isinstance(default, ast.Call)
        and getattr(default.func, "id", getattr(default.func, "attr", None)) == "schema_default"
        and [a.value for a in default.args if isinstance(a, ast.Constant)][1:] == [name]
        and [a.value for a in default.args if isinstance(a, ast.Constant)][:1] in [s[-1:] for s in sections]
    )


def field_default(value):
    """A class field's default: the value, or field(default=...) / field(default_factory=...); None when none."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        kw = {k.arg: k.value for k in value.keywords}
        return kw.get("default") or kw.get("default_factory")
    return value


def defaults(tree):
    """(where, name, default) of every parameter default, class field default and .get(key, default) in a tree;
    `where` is the enclosing function or class."""

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                name = "<lambda>" if isinstance(child, ast.Lambda) else child.name
                inner = where if name == "__init__" else name  # a constructor's parameters are its class's
                a = child.args
                pos = a.posonlyargs + a.args
                yield from (
                    (inner, p.arg, d) for p, d in zip(pos[len(pos) - len(a.defaults) :], a.defaults, strict=True)
                )
                yield from (
                    (inner, p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None
                )
            elif isinstance(child, ast.ClassDef):
                inner = child.name
                for stmt in child.body:
                    is_field = isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value
                    if is_field and (d := field_default(stmt.value)) is not None:
                        yield inner, stmt.target.id, d
            elif (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr in ("get", "setdefault", "pop")
                and len(child.args) == 2
                and isinstance(child.args[0], ast.Constant)
                and isinstance(child.args[0].value, str)
            ):
                yield where, child.args[0].value, child.args[1]
            yield from visit(child, inner)

    yield from visit(tree, "<module>")


def second_defaults():
    keys, found = schema_keys(), []
    for path in sorted([*PACKAGE.rglob("*.py"), *(REPO / "scripts").glob("*.py")]):
        if path.is_relative_to(FIXTURES):
            continue
        rel = path.relative_to(PACKAGE if path.is_relative_to(PACKAGE) else REPO).as_posix()
        for where, name, default in defaults(ast.parse(path.read_text(encoding="utf-8"))):
            if name in keys and not from_schema(default, name, keys[name]):
                found.append((f"{rel}:{where}:{name}", ast.unparse(default)))
    return found


def test_no_schema_key_has_a_second_default_in_code():
    found = second_defaults()
    hits = [f"{site} = {value}" for site, value in found if site not in NOT_CONFIG and site not in LEFT]
    assert not hits, f"take the value from the config or settings, or schema_default(section, key): {hits}"
    stale = (set(NOT_CONFIG) | LEFT) - {site for site, _ in found}
    assert not stale, f"NOT_CONFIG or LEFT entries that match nothing any more: {sorted(stale)}"


# Parameters that still default to schema_default(...), to be given by every caller: heal.find's callers pass
# SETTINGS.heal.keep_failed already.
SIGNATURE_LEFT = {"healing/heal.py:find:keep_failed"}


def config_parameters(tree):
    """(function, parameter) of every parameter of a function or lambda in `tree` whose default is a
    schema_default(...) call."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = node.args
            pos = a.posonlyargs + a.args
            pairs = [*zip(pos[len(pos) - len(a.defaults) :], a.defaults, strict=True),
                     *zip(a.kwonlyargs, a.kw_defaults, strict=True)]  # fmt: skip
            for p, d in pairs:
                if (
                    isinstance(d, ast.Call)
                    and getattr(d.func, "id", getattr(d.func, "attr", None)) == "schema_default"
                ):
                    yield getattr(node, "name", "<lambda>"), p.arg


def test_no_signature_takes_a_config_value_as_its_default():
    """A config value reaches a function from its caller: a stage's job entry (run_<stage>_job) reads it from the
    stage's typed settings (eagle3prep.settings) and passes it on, so no parameter defaults to the schema's value."""
    found = set()
    for path in sorted([*PACKAGE.rglob("*.py"), *(REPO / "scripts").glob("*.py")]):
        rel = path.relative_to(PACKAGE if path.is_relative_to(PACKAGE) else REPO).as_posix()
        found |= {f"{rel}:{f}:{p}" for f, p in config_parameters(ast.parse(path.read_text(encoding="utf-8")))}
    assert not found - SIGNATURE_LEFT, (
        f"pass the value from the stage's settings instead: {sorted(found - SIGNATURE_LEFT)}"
    )
    assert not SIGNATURE_LEFT - found, (
        f"SIGNATURE_LEFT entries that match nothing any more: {sorted(SIGNATURE_LEFT - found)}"
    )
    code = 'def f(a, b=schema_default("x", "b"), *, c=config.schema_default("x", "c"), d=1): ...\ng = lambda e=schema_default("x", "e"): e'
    assert set(config_parameters(ast.parse(code))) == {("f", "b"), ("f", "c"), ("<lambda>", "e")}


def test_the_scan_sees_each_form_of_default():
    code = """
def f(workers=1, *, trust_remote_code=False, storage=schema_default("extract", "storage")): ...
class C:
    template_fallback: bool = True
    storage: str = field(metadata={})
    dtype: str = field(default="float16")
x = d.get("max_image_pixels", 10)
"""
    found = {(w, n) for w, n, d in defaults(ast.parse(code)) if not from_schema(d, n, schema_keys().get(n, []))}
    assert found == {("f", "workers"), ("f", "trust_remote_code"), ("C", "template_fallback"), ("C", "dtype"),
                     ("<module>", "max_image_pixels")}  # fmt: skip
