"""The report's data (eagle3prep.report.data) on small hand-made inputs, and the page on the demo run's outputs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from eagle3prep.report import build_report
from eagle3prep.report import data as rd
from eagle3prep.settings import ExtractSettings


def test_funnel_accounts_for_every_row_and_names_the_reasons():
    counts = {"totals": {"rows_in": 20, "duplicates": 3, "kept": 14, "files": 2, "quarantined": {"bad": 2, "x": 1}}}
    stats = {"rows": 13, "tokens": 900, "max_seq_len": 64, "truncated_rows": 4, "quarantined": {"no_assistant": 1}}
    steps = {name: (n, note) for name, n, note in rd.funnel(counts, stats)}
    assert steps["quarantined by prepare"] == (-3, "bad 2, x 1")
    assert 20 + steps["duplicates dropped"][0] + steps["quarantined by prepare"][0] == 14
    assert 14 + steps["quarantined by tokenize"][0] == steps["rows out (tokenized, captured)"][0] == 13
    assert steps["truncated to 64 tokens (kept)"] == (4, "30.8% of rows; tokens cut: not in stats.json")
    steps = {name: note for name, _, note in rd.funnel(counts, {**stats, "truncated_tokens": 100})}
    assert steps["truncated to 64 tokens (kept)"].endswith("100 tokens cut (10.00% of all)")


def test_reference_skipped_in_new_and_old_validation_files():
    assert rd.reference_skipped({"rows": 5, "reference_mode": "off"})
    assert rd.reference_skipped({"rows": 5, "reference_mode": "full"})  # sample_rows: 0, nothing recomputed
    assert rd.reference_skipped({"rows": 5})  # an older file without the key
    assert not rd.reference_skipped({"rows": 5, "reference_mode": "full", "reference": [{"row": 0}]})
    assert not rd.reference_skipped({"rows": 0, "reference_mode": "full"})  # an empty shard has nothing to check


def test_reference_margins_from_layer_summaries_or_from_rows():
    new = {"reference_layers": {"8": {"worst_margin": 0.4}, "2": {"worst_margin": 0.9}}}
    old = {
        "reference": [{"layer_id": 2, "rel": 0.1, "bound_rel": 0.2}, {"layer_id": 2, "rel": 0.375, "bound_rel": 0.5}]
    }
    assert rd.reference_margins([new, old, {}]) == {"2": [0.9, 0.75, None], "8": [0.4, None, None]}


def test_check_grid_shows_failures_with_their_detail_and_a_skipped_reference():
    checks = [
        {"check": "manifest", "ok": True, "detail": ""},
        {"check": "file:layer_2.safetensors", "ok": True, "detail": "sha256 matches"},
        {"check": "file:layer_8.safetensors", "ok": False, "detail": "sha256 ab != cd"},
    ]
    columns, grid = rd.check_grid([{"rows": 3, "reference_mode": "off", "checks": checks}])
    row = dict(zip(columns, grid[0], strict=True))
    assert row["manifest"][0] == "ok"
    assert row["sha256"] == ("FAIL", "file:layer_8.safetensors: sha256 ab != cd")
    assert row["reference"][0] == "skipped" and row["token ids"][0] == "-"


def test_vocab_coverage_is_the_share_of_masked_tokens_in_the_top_ids():
    cov = rd.vocab_coverage({"7": 50, "3": 30, "9": 20}, sizes=(1, 2, 8))
    assert cov["at"] == {1: 0.5, 2: 0.8, 8: 1.0}
    assert cov["distinct_ids"] == 3 and cov["masked_tokens"] == 100
    assert cov["curve"][0] == (1, 0.5) and cov["curve"][-1] == (3, 1.0)


def test_sampled_outlier_share_reads_the_layer_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    x = torch.ones(100, 4)  # token norm 2
    x[::10] *= 20  # every 10th token: norm 40
    save_file({"hidden_states": x.to(torch.bfloat16)}, tmp_path / "layer_2.safetensors")
    index = [{"row": r, "id": str(r), "offset": 10 * r, "length": 10} for r in range(10)]
    (tmp_path / "index.json").write_text(json.dumps(index))
    mean_norm = float(x.norm(dim=-1).mean())  # 5.8: the outliers are ~6.9x it, the rest 0.34x
    shares = rd.sampled_outlier_shares(tmp_path, {"layer_stats": {"2": {"mean_token_norm": mean_norm}}})
    assert shares == {"2": pytest.approx(0.1)}


def _report_inputs(wd, out, reports: list[dict]) -> dict:
    """build_report's arguments on a finished demo run, with the validation files replaced by `reports`."""
    n = len(reports)
    for k, v in enumerate(reports):
        (out / f"v{k}.json").write_text(json.dumps(v))
    return dict(
        validations=[str(out / f"v{k}.json") for k in range(n)],
        shard_dirs=[str(wd / f"results/hidden_states/shard_{k}") for k in range(n)],
        tokenized=[str(wd / f"results/tokenized/shard_{k}.jsonl") for k in range(n)],
        counts_path=str(wd / "results/prepared/counts.json"),
        stats_path=str(wd / "results/tokenized/stats.json"),
        token_freq_path=str(wd / "results/tokenized/token_freq.json"),
        benchmarks=[str(wd / f"benchmarks/extract/shard_{k}.tsv") for k in range(n)],
        out_html=str(out / "report.html"),
        out_csv=str(out / "summary.csv"),
        out_manifest=str(out / "dataset_manifest.json"),
        model_dir=str(wd / "results/demo/model"),
    )


@pytest.mark.integration
def test_page_flags_a_skipped_reference_and_a_near_miss(small_demo_run, tmp_path):
    wd = small_demo_run
    reports = [json.loads((wd / f"results/validation/shard_{k}.json").read_text()) for k in range(3)]
    page = (wd / "results/report/report.html").read_text()
    assert "Every check passed on every shard, the reference check included." in page
    assert "Reference check SKIPPED" not in page and "Draft-vocabulary coverage" in page

    off = copy.deepcopy(reports)
    for v in off:  # what `validate.reference: false` writes
        v["reference_mode"] = "off"
        v["checks"] = [c for c in v["checks"] if not c["check"].startswith("reference")]
        for key in ("reference", "reference_layers", "reference_sample", "reference_floor"):
            v.pop(key, None)
    build_report(**_report_inputs(wd, tmp_path, off))
    page = (tmp_path / "report.html").read_text()
    assert "Reference check SKIPPED on every shard" in page and "<td class='skipped'" in page

    near = copy.deepcopy(reports)
    near[1]["reference_layers"]["5"]["worst_margin"] = 0.93
    dataset = build_report(**_report_inputs(wd, tmp_path, near))
    page = (tmp_path / "report.html").read_text()
    assert "Near the reference bound" in page and "layer 5: 0.93" in page
    assert dataset["sources"] == ["resources/demo/sharegpt.jsonl", "resources/demo/openai.parquet"]
    assert dataset["reference"].startswith(f"{sum(v['reference_sample']['rows'] for v in near)} of ")
    assert "src='data:image/png;base64," in page  # self-contained: the figures are inlined
    assert page.count("<div class='row'>") == 3 and "&lt;|im_start|&gt;" in page  # sample rows, template tokens


# ---- issue #27 item 8: figures that add up, say what passes, stay visible; sample rows ---------------------
# (run before the fix, each of these failed: see the commit message)


@pytest.fixture(scope="module")
def demo_shard(tmp_path_factory, demo_model_dir):
    """One demo-sized shard (3 rows) and its tokenized file, captured by the hf backend."""
    from shard_helpers import demo_spec, write_tokenized

    from eagle3prep.extract import extract_shard

    root = tmp_path_factory.mktemp("report_shard")
    tokens = write_tokenized(root / "tokens.jsonl", [23, 41, 17], seed=0)
    extract_shard(
        str(tokens),
        str(root / "shard"),
        demo_spec(demo_model_dir),
        ExtractSettings.defaults(batch_tokens=128),
        shard=0,
    )
    return root / "shard", tokens


class _Refs:
    """A reference that recomputes nothing: the verdicts come from the patched judge_row."""

    def rows(self, input_ids, lids, pixels=None):
        return {lid: None for lid in lids}, None

    def margins(self, input_ids, lid, pixels=None):
        return None

    def describe(self):
        return "none"


def test_validation_detail_figures_add_up(demo_shard, monkeypatch):
    """Row 0 has the largest error, row 1 is nearest its (narrower) bound: the line quoting
    'error ... x its bound ...' must quote one row's error, ratio and bound (the issue's 0.0199 / 0.0657 != 0.25)."""
    import re

    from eagle3prep.check import Checks
    from eagle3prep.shard.shardset import open_shard, read_tokenized
    from eagle3prep.validate import recompute
    from eagle3prep.validate.passrule import judge_tokens
    from eagle3prep.validate.subject import ShardUnderTest

    figures = {0: (0.0199, 0.1), 1: (0.0164, 0.0657), 2: (0.001, 0.01)}  # row: (rel, bound_rel)
    calls = iter(r for r in (0, 1, 2) for _ in range(4))  # judge_row runs row by row, layer by layer

    def judge_row(*args, **kwargs):
        rel, bound = figures[next(calls)]
        return {**judge_tokens([0.0] * 5, None, "bfloat16"), "rel": rel, "bound_rel": bound, "min_cos": 1.0}

    monkeypatch.setattr(recompute, "judge_row", judge_row)
    shard_dir, tokens = demo_shard
    subject = ShardUnderTest(open_shard(shard_dir, read_tokenized(tokens, records=True)))
    checks = Checks()
    recompute.check_reference(subject, _Refs(), [0, 1, 2], checks, images=None)  # text rows: no pixels asked
    details = [c.detail for c in checks.items if c.name.startswith("reference:")]
    assert len(details) == 4
    for d in details:
        quoted = re.search(r"([0-9.]+)\D{0,12}?\(?\s*=?\s*([0-9.]+) (?:of|x) its bound ([0-9.]+)", d)
        assert quoted, d
        rel, ratio, bound = map(float, quoted.groups())
        assert rel / bound == pytest.approx(ratio, abs=0.006), d  # the three figures are one row's
        assert "row 1" in d and "largest error of any row 0.0199 (row 0" in d
        assert "RMS over the row's tokens" in d and "passes below 1" in d


def test_kpi_tile_says_below_one_passes():
    from eagle3prep.report import page

    ctx = {
        "dataset": {"rows": 2, "tokens": 10, "bytes": 0, "layer_ids": [2]},
        "stats": {},
        "counts": {"totals": {"rows_in": 2}},
        "reports": [{"ok": True}],
        "margins": {"2": [0.25]},
        "coverage": {"at": {}},
    }
    assert "worst reference error / bound (below 1 passes)<b>0.25</b>" in page.kpis(ctx)


def _figures(monkeypatch):
    """Capture the matplotlib figures the plots module makes instead of encoding them."""
    from eagle3prep.report import plots

    figs = []
    monkeypatch.setattr(plots, "_png", lambda fig: figs.append(fig) or "")
    return plots, figs


def test_layers_with_equal_values_draw_apart_and_say_so(monkeypatch):
    plots, figs = _figures(monkeypatch)
    margins = {lid: [0.25, 0.25, 0.25] for lid in ("2", "4", "5", "8")}  # the demo: captured == floor run
    plots.reference_margin(margins, 3)
    ax = figs[0].axes[0]
    layer_lines = [line for line in ax.lines if line.get_label().startswith("layer ")]
    assert len({tuple(line.get_xdata()) for line in layer_lines}) == 4  # four lines, none hidden behind another
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("layers 2, 4, 5, 8: equal" in t for t in labels) and "bound (passes below 1)" in labels


def test_length_histogram_marks_the_truncation_cap(monkeypatch):
    import pandas as pd

    plots, figs = _figures(monkeypatch)
    rows = pd.DataFrame({"seq_len": [40, 60, 90, 127, 128, 128, 128], "mask_share": [0.5] * 7})
    plots.distributions(rows, 128, 3)
    ax = figs[0].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "max_seq_len 128" in labels and "at max_seq_len (3 rows cut to it)" in labels
    cap_bars = [p for p in ax.patches if p.get_height() > 0 and p.get_x() >= 128]
    assert [p.get_height() for p in cap_bars] == [3]  # the cap's rows are one bar of their own, not mixed with 127


def test_figures_hold_their_labels_when_saved(monkeypatch):
    """A label outside the canvas (a squeezed layout) is kept in the PNG, not cut at its edge."""
    import base64
    import io

    from PIL import Image

    from eagle3prep.report import plots

    plt = plots._pyplot()
    fig, ax = plt.subplots(figsize=(plots.WIDTH_IN, 1.0))  # no layout engine: the x label falls off
    ax.set_xlabel("a label below the canvas")
    fig.canvas.draw()
    below = fig.get_tightbbox(fig.canvas.get_renderer()).y0 < 0
    height = Image.open(io.BytesIO(base64.b64decode(plots._png(fig)))).size[1]
    assert below and height > 1.0 * plots.DPI


def test_sample_rows_show_trained_tokens_and_template_tokens(demo_model_dir, tmp_path):
    """Rows from different shards; trained runs are exactly the loss-masked tokens; template tokens boxed."""
    import re

    from eagle3prep.report import page, samples
    from eagle3prep.tokenization.template import load_tokenizer

    tok = load_tokenizer(demo_model_dir)
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello, friend."}]
    paths = []
    for k in range(4):
        ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        split = len(tok.apply_chat_template(chat[:1], tokenize=True, add_generation_prompt=True, return_dict=False))
        mask = [0] * split + [1] * (len(ids) - split)
        p = tmp_path / f"shard_{k}.jsonl"
        rows = [{"row": 10 * k + i, "id": f"r{k}{i}", "input_ids": ids, "loss_mask": mask, "seq_len": len(ids)}
                for i in range(2)]  # fmt: skip
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(p))
    got = samples.samples(paths, tok)
    assert [s.shard for s in got] == [0, 2, 3]  # spread over the run
    s = got[0]
    trained = "".join(text for text, t, _ in s.segments if t)
    assert trained == tok.decode(ids[split:], skip_special_tokens=False)
    special = [text for text, _, sp in s.segments if sp]
    assert special and all(
        x in {tok.convert_ids_to_tokens(i) for i in samples.template_token_ids(tok)} for x in special
    )
    html = page.sample_rows(got, "")
    assert html.count("<div class='row'>") == 3 and "shard 2, row 20" in html
    assert re.search(r"<span class='sp [tu]'>", html) and "<span class='t'>" in html and "<span class='u'>" in html


def test_page_links_the_quality_measurement(tmp_path):
    from eagle3prep.report.page import quality_note

    doc = tmp_path / "quality.md"
    assert "docs/quality.md" in quality_note(doc) and "href" not in quality_note(doc)  # absent: named, not linked
    doc.write_text("x")
    assert f"href='{doc.as_uri()}'" in quality_note(doc)
    assert (Path(__file__).parents[1] / "docs/quality.md").as_uri() in quality_note()  # the repository's own


def test_funnel_notes_rows_that_end_in_a_user_turn():
    """Such a row is kept and its replies trained on, but its last user message is context no reply follows."""
    counts = {"totals": {"rows_in": 5, "duplicates": 0, "kept": 5, "files": 1, "quarantined": {}}}
    stats = {"rows": 5, "tokens": 500, "max_seq_len": 64, "quarantined": {}}
    assert not any("user turn" in step for step, _, _ in rd.funnel(counts, stats))
    steps = {step: (n, note) for step, n, note in rd.funnel(counts, {**stats, "trailing_user_rows": 2})}
    n, note = steps["ending in a user turn (kept)"]
    assert n == 2 and note.startswith("40.0% of rows; the last user message has no reply after it")
