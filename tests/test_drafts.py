"""Drafts named in the config (layers.drafts): each draft's layers in its own numbering, the union captured once,
shown at parse time and in the plan, refused in one line when a finished dataset lacks them or the target has none."""

from __future__ import annotations

import json

import pytest

from eagle3prep.config import ConfigError, validate_config
from eagle3prep.drafts import capture_layer_ids, draft_lines, missing_layers, resolve_drafts, trainer_args
from eagle3prep.run.parse import check_model
from eagle3prep.settings import LayersSettings, Settings

KIMI_N = 61
# Published DFlash drafts for Kimi-K2.5 (dflash_config.target_layer_ids, "output of layer i")
KIMI_DFLASH = {"type": "dflash", "ids": [1, 12, 24, 35, 47, 58], "convention": "output_of_layer"}


def base(**over):
    return {"data": {"sources": ["a.jsonl"]}, "model": {"path": "m"}, **over}


def model_folder(tmp_path, n: int) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": n, "hidden_size": 64}))
    return str(tmp_path)


def test_each_algorithm_reads_its_aux_layers_then_the_final_state():
    eagle3, dflash, mtp = resolve_drafts([{"type": "eagle3"}, KIMI_DFLASH, {"type": "mtp"}], KIMI_N)
    assert eagle3.reads == [2, 30, 58, 61] and list(eagle3.aux) == [2, 30, 58]  # speculators' [2, N//2, N-3]
    assert dflash.reads == [2, 13, 25, 36, 48, 59, 61]  # output_of_layer + 1, then N
    assert mtp.reads == [61] and mtp.aux == ()  # MTPDraftModel.target_layer_ids == [N]
    union = capture_layer_ids(None, "input_of_layer", [{"type": "eagle3"}, KIMI_DFLASH, {"type": "mtp"}], KIMI_N)
    assert union == [2, 13, 25, 30, 36, 48, 58, 59, 61]


def test_each_type_gets_the_trainer_flags_it_takes():
    """The flags every draft trainer of the quality bench and of test_draft_views.py gets, by type: its ids, a draft
    vocabulary but for dflash2 and mtp, blocks for the block drafts, nothing of attention or layers for mtp."""
    by_type = {d.type: d for d in resolve_drafts([{"type": t} for t in ("eagle3", "dflash2", "dspark", "mtp")], 8)}
    common = ["--loss-implementation", "eager", "--draft-attn-impl", "sdpa", "--num-layers", "1"]
    assert trainer_args(by_type["eagle3"], 64, block_size=4) == [
        *("--speculator-type", "eagle3", "--target-layer-ids", "2", "4", "5", "--draft-vocab-size", "64"), *common
    ]  # fmt: skip
    assert trainer_args(by_type["dflash2"], 64, block_size=4)[6:] == [*common, "--block-size", "4"]
    assert trainer_args(by_type["dspark"], 64)[-2:] == ["--num-layers", "1"]  # no block size: speculators' default
    assert trainer_args(by_type["mtp"], 64, block_size=4) == ["--speculator-type", "mtp"]


def test_the_sources_numberings_are_one_conversion():
    # vLLM's eagle_aux_hidden_state_layer_ids and speculators' --target-layer-ids are ours; published DFlash ids
    # and older speculators' are one lower (speculators' DFlash converter adds 1).
    same = [resolve_drafts([{"type": "dflash", "ids": [2, 13, 59], "convention": c}], KIMI_N)[0].reads
            for c in ("input_of_layer", "vllm", "speculators")]  # fmt: skip
    assert same == [[2, 13, 59, 61]] * 3
    shifted = resolve_drafts([{"type": "dflash", "ids": [1, 12, 58], "convention": "output_of_layer"}], KIMI_N)
    assert shifted[0].reads == [2, 13, 59, 61]
    # id N listed among the aux ids is read once, as the last slot (as speculators' DFlash converter drops it)
    last = resolve_drafts([{"type": "dflash", "ids": [2, 60], "convention": "output_of_layer"}], KIMI_N)[0]
    assert last.reads == [3, 61] and last.aux == (3,)


def test_explicit_layer_ids_are_kept_and_extended():
    assert capture_layer_ids([3, 31, 59, 61], "input_of_layer", [{"type": "mtp"}], KIMI_N) == [3, 31, 59, 61]
    assert capture_layer_ids([5, 61], "input_of_layer", [{"type": "eagle3"}], KIMI_N) == [2, 5, 30, 58, 61]
    # without drafts nothing changes: the default is EAGLE-3's
    assert capture_layer_ids(None, "input_of_layer", [], KIMI_N) == [2, 30, 58, 61]


@pytest.mark.parametrize(
    ("drafts", "match"),
    [
        (
            [{"type": "dflash", "ids": [1, 62]}],
            r"^layers.drafts\[0\] \(dflash\).ids = \[1, 62\] has ids \[62\] outside",
        ),
        ([{"type": "dflash", "ids": [1, 61], "convention": "output_of_layer"}], r"\(output_of_layer\) has ids \[61\]"),
        ([{"type": "mtp", "ids": [3]}], r"^layers.drafts\[0\] \(mtp\): mtp reads the pre-norm final state"),
        (
            [{"type": "dflash"}, {"type": "dflash", "ids": [3]}],
            r"^layers.drafts\[1\] \(dflash\): two drafts are named",
        ),
        ([{"type": "dflash", "ids": [9, 3]}], "ascending"),
    ],
)
def test_bad_drafts_are_named_in_one_line(drafts, match):
    with pytest.raises(ValueError, match=match) as e:
        resolve_drafts(drafts, KIMI_N)
    assert "\n" not in str(e.value)


def test_schema_refuses_an_unknown_type_and_key(tmp_path):
    with pytest.raises(ConfigError, match="drafts"):
        Settings.validated(base(layers={"drafts": [{"type": "medusa"}]}))
    with pytest.raises(ConfigError, match="drafts"):
        Settings.validated(base(layers={"drafts": [{"type": "dflash", "layer_ids": [1]}]}))


def test_parse_time_shows_each_draft_and_the_union_and_refuses_ids_outside_the_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = model_folder(tmp_path, 8)
    drafts = [{"type": "eagle3"}, {"type": "dflash", "ids": [0, 3, 6], "convention": "output_of_layer"}]
    notes = check_model(Settings.validated(base(model={"path": path}, layers={"drafts": drafts})))
    assert notes == [
        "layers.drafts: draft eagle3 (eagle3) reads layers [2, 4, 5, 8] (--target-layer-ids 2 4 5)",
        "layers.drafts: draft dflash (dflash) reads layers [1, 4, 7, 8] (--target-layer-ids 1 4 7)",
        "layers.drafts: captured once for all drafts: the union [1, 2, 4, 5, 7, 8] (input_of_layer)",
    ]
    bad = [{"type": "dflash", "ids": [1, 9]}]
    with pytest.raises(
        ConfigError, match=r"^config error: layers.drafts\[0\] \(dflash\).ids = \[1, 9\] has ids \[9\]"
    ):
        check_model(Settings.validated(base(model={"path": path}, layers={"drafts": bad})))


def finished_shard(root, k: int, ids: list[int]) -> None:
    shard = root / f"results/hidden_states/shard_{k}"
    shard.mkdir(parents=True)
    (shard / "manifest.json").write_text(json.dumps({"layer_ids": ids}))


def test_a_draft_a_finished_dataset_cannot_serve_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = model_folder(tmp_path, 8)
    for k in range(2):
        finished_shard(tmp_path, k, [2, 4, 5, 8])
    served = base(model={"path": path}, layers={"drafts": [{"type": "eagle3"}, {"type": "mtp"}]})
    assert len(check_model(Settings.validated(served))) == 3
    lacking = base(model={"path": path}, layers={"drafts": [{"type": "dflash", "ids": [1, 4]}]})
    with pytest.raises(ConfigError) as e:
        check_model(Settings.validated(lacking))
    assert str(e.value) == (
        "config error: layers.drafts: draft dflash reads layer ids [1] that the finished shards in "
        "results/hidden_states do not hold (they hold [2, 4, 5, 8]); capturing them extracts every shard again: "
        "set replace_results: true to do so, or drop the draft"
    )
    assert check_model(Settings.validated({**lacking, "replace_results": True}))


def test_the_rules_layers_param_changes_only_when_a_draft_adds_layers(tmp_path):
    """The extract rule's `layers` param is its rerun trigger: a draft the shards already serve must not redo them."""
    path = model_folder(tmp_path, 8)

    def cfg(layers, model=path):
        return validate_config(base(model={"path": model}, layers=layers))

    before = {"ids": None, "convention": "input_of_layer"}
    assert LayersSettings.params(cfg({})) == before  # no `drafts` key: runs made before it are not re-queued
    assert LayersSettings.params(cfg({"drafts": [{"type": "eagle3"}, {"type": "mtp"}]})) == before
    dflash = [{"type": "dflash", "ids": [1, 4]}]
    adds = LayersSettings.params(cfg({"drafts": dflash}))
    assert adds == {"ids": [1, 4, 8], "convention": "input_of_layer"}
    assert LayersSettings.of(adds).capture_ids(8) == [1, 4, 8]
    # no model folder to read N from: the drafts travel, and the job resolves them
    later = LayersSettings.params(cfg({"drafts": [{"type": "mtp"}]}, model=str(tmp_path / "not_yet")))
    assert [d["type"] for d in later["drafts"]] == ["mtp"] and LayersSettings.of(later).capture_ids(8) == [8]
    # the demo's, before model.build_demo builds it: its depth is known, so the param does not change once it is built
    demo = validate_config(base(model={"path": str(tmp_path / "demo"), "build_demo": True}, layers={"drafts": dflash}))
    assert LayersSettings.params(demo) == adds


def test_draft_lines_carry_the_storage_bytes():
    drafts = resolve_drafts([{"type": "eagle3"}, {"type": "mtp"}], KIMI_N)
    lines = draft_lines(drafts, [2, 30, 58, 61], token_bytes=7168 * 2, tokens=1_000_000)
    assert lines[0].endswith("57,344 B/token, 57.34 GB") and lines[1].endswith("14,336 B/token, 14.34 GB")
    assert missing_layers(drafts, [2, 30, 61]) == {"eagle3": [58]}


def test_plan_shows_each_drafts_layers_and_bytes_in_the_storage_format(tmp_path, demo_model_dir):
    from eagle3prep.plan.stage import plan_run
    from eagle3prep.shard.formats import storage_format

    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"shards": [{"shard": 0, "path": "x", "first_row": 0, "rows": 10, "tokens": 3000}]}))
    drafts = [
        {"type": "eagle3"},
        {"type": "dflash", "ids": [0, 3, 6], "convention": "output_of_layer"},
        {"type": "mtp"},
    ]
    settings = Settings.validated(base(model={"path": str(demo_model_dir)}, layers={"drafts": drafts}))
    args = {"layers": settings.layers, "plan": settings.plan, "model_path": str(demo_model_dir), "dtype": "bfloat16"}
    args |= {"windows": None, "reference": False, "validate_device": "cpu", "sample_rows": 8}
    for storage in ("model_dtype", "mxfp4"):
        text = plan_run(stats, tmp_path / "hs", tmp_path / f"{storage}.json", tmp_path / f"{storage}.txt",
                        storage=storage, **args)  # fmt: skip
        plan = json.loads((tmp_path / f"{storage}.json").read_text())
        per_layer = storage_format(storage).token_bytes(128, "bfloat16")
        assert plan["num_layers"] == 6  # the union [1, 2, 4, 5, 7, 8], captured once
        assert [(d["name"], d["reads"], d["bytes"]) for d in plan["drafts"]] == [
            ("eagle3", [2, 4, 5, 8], 4 * per_layer * 3000),
            ("dflash", [1, 4, 7, 8], 4 * per_layer * 3000),
            ("mtp", [8], per_layer * 3000),
        ]
        assert (
            f"draft mtp (mtp) reads layers [8] (--target-layer-ids (none: the final state only)), {per_layer:,} B/token"
            in text
        )
        assert (
            f"captured once for all drafts: the union [1, 2, 4, 5, 7, 8] (input_of_layer), {6 * per_layer:,} B/token"
            in text
        )


def test_the_report_says_which_drafts_the_dataset_serves_and_the_bytes_each_reads():
    from eagle3prep.report.drafts import drafts_section, served

    # Kimi-K2.5's depth, EAGLE-3's default layers plus a published DFlash draft's, stored in MXFP4
    ids = capture_layer_ids(None, "input_of_layer", [{"type": "eagle3"}, KIMI_DFLASH], KIMI_N)
    dataset = {"num_hidden_layers": KIMI_N, "layer_ids": ids, "hidden_size": 7168, "dtype": "bfloat16",
               "storage": {"name": "mxfp4"}, "tokens": 1000}  # fmt: skip
    rows = {r["type"]: r for r in served(dataset)}
    assert rows["eagle3"]["held"] and rows["mtp"]["held"] and rows["mtp"]["reads"] == [61]
    per_layer = 7168 // 2 + 7168 // 32  # MXFP4: 4 bits a value and one scale byte a block of 32
    assert rows["eagle3"]["bytes_per_token"] == 4 * per_layer and rows["mtp"]["bytes"] == per_layer * 1000
    html = "".join(drafts_section(dataset))
    assert "Drafts this dataset serves" in html and "[2, 13, 25, 30, 36, 48, 58, 59, 61]" in html
    # a dataset without the final state serves no draft, and says why
    assert "lack the pre-norm final state" in "".join(drafts_section({**dataset, "layer_ids": [2, 30]}))
    partial = {r["type"]: r for r in served({**dataset, "layer_ids": [2, 61]})}
    assert not partial["dflash"]["held"] and partial["dflash"]["missing"] == [30, 58]


# ---- the numbering on every family of the validation matrix ---------------------------------------------------


def family_model(family: str):
    """(tiny random model of `family`, its text config's N), built in memory as the validation matrix builds it."""
    from eagle3prep.demo import build_tokenizer

    from testkit import tiny_kimi, tiny_models, tiny_vl

    if family == "kimi_int4":  # the INT4 target's bf16 twin: the same decoder stack
        return tiny_kimi.build_model(build_tokenizer(tiny_models.DEFAULT_CORPUS))
    if family == "qwen2_5_vl":
        return tiny_vl.build_model(tiny_vl.build_vl_tokenizer())
    return tiny_models.build_model(family, build_tokenizer(tiny_models.DEFAULT_CORPUS))


@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3", "kimi_int4", "qwen2_5_vl"]
)
def test_a_published_drafts_ids_are_the_outputs_of_those_layers_on_every_family(family):
    """A DFlash draft's published ids j ("output of layer j") become ours j + 1, whose hook (layers.hook_point, the
    one both capture backends use) sees exactly the output of decoder layer j: transformers' output_hidden_states
    [j + 1], and for j = N - 1 the last layer's output before the final norm (normed, it is hidden_states[N])."""
    import torch

    from eagle3prep.layers import decoder_stack, hook_point

    model = family_model(family)
    stack = decoder_stack(model)
    n = len(stack.layers)
    published = [0, n // 2, n - 1]
    draft = resolve_drafts([{"type": "dflash", "ids": published, "convention": "output_of_layer"}], n)[0]
    assert draft.reads == [1, n // 2 + 1, n]  # n - 1 + 1 = N is the last slot, read once
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for lid in draft.reads:
        layer, where = hook_point(lid, n)
        assert (layer, where) == (lid - 1, "output")  # published j is the output of decoder layer j
        handles.append(stack.layers[layer].register_forward_hook(
            lambda _m, _a, out, lid=lid: seen.__setitem__(lid, (out[0] if isinstance(out, tuple) else out).detach())
        ))  # fmt: skip
    ids = torch.arange(5, 29).unsqueeze(0)
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    for h in handles:
        h.remove()
    for lid in draft.aux:
        assert torch.equal(seen[lid], hs[lid]), (family, lid)
    torch.testing.assert_close(stack.norm(seen[n]), hs[n])  # transformers' last entry is after the final norm
    assert not torch.allclose(seen[n], hs[n])  # and the pre-norm state the drafts read is not it
