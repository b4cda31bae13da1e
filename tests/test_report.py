"""The report's data (eagle3prep.report.data) on small hand-made inputs, and the page on the demo run's outputs."""

from __future__ import annotations

import copy
import html
import json
import re
from pathlib import Path

import pytest

from eagle3prep.report import ReportJobSettings, ReportPaths, run_report_job
from eagle3prep.report import data as rd
from eagle3prep.settings import ExtractSettings

from testkit.shards import with_settings


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
    """run_report_job's paths on a finished demo run, with the validation files replaced by `reports`."""
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
    run_report_job(ReportPaths(**_report_inputs(wd, tmp_path, off)), ReportJobSettings())
    page = (tmp_path / "report.html").read_text()
    assert "Reference check SKIPPED on every shard" in page and "<td class='skipped'" in page

    near = copy.deepcopy(reports)
    near[1]["reference_layers"]["5"]["worst_margin"] = 0.93
    dataset = run_report_job(ReportPaths(**_report_inputs(wd, tmp_path, near)), ReportJobSettings())
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
    from eagle3prep.extract import extract_shard

    from testkit.shards import demo_spec, write_tokenized

    root = tmp_path_factory.mktemp("report_shard")
    tokens = write_tokenized(root / "tokens.jsonl", [23, 41, 17], seed=0)
    extract_shard(
        str(tokens),
        str(root / "shard"),
        with_settings(demo_spec(demo_model_dir), ExtractSettings.defaults(batch_tokens=128)),
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
    assert "max_seq_len 128" in labels and "at max_seq_len: 3 rows (3 cut to it)" in labels
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
    from eagle3prep.tokenize.template import load_tokenizer

    tok = load_tokenizer(demo_model_dir, trust_remote_code=False)
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

    doc = tmp_path / "evidence.md"
    assert "docs/evidence.md" in quality_note(doc) and "href" not in quality_note(doc)  # absent: named, not linked
    doc.write_text("x")
    assert f"href='{doc.as_uri()}'" in quality_note(doc)
    assert (Path(__file__).parents[1] / "docs/evidence.md").as_uri() in quality_note()  # the repository's own


def test_funnel_notes_rows_that_end_in_a_user_turn():
    """Such a row is kept and its replies trained on, but its last user message is context no reply follows."""
    counts = {"totals": {"rows_in": 5, "duplicates": 0, "kept": 5, "files": 1, "quarantined": {}}}
    stats = {"rows": 5, "tokens": 500, "max_seq_len": 64, "quarantined": {}}
    assert not any("user turn" in step for step, _, _ in rd.funnel(counts, stats))
    steps = {step: (n, note) for step, n, note in rd.funnel(counts, {**stats, "trailing_user_rows": 2})}
    n, note = steps["ending in a user turn (kept)"]
    assert n == 2 and note.startswith("40.0% of rows; the last user message has no reply after it")


# ---- the reference plot when every layer sits at one value; provenance; the length legend; losses per source;
# tool calls quarantined (run before the fix, each of these failed: see the commit message)

DEMO_MARGINS = {  # the demo run's: every layer within 0.002 of 0.25 on every shard (captured == floor run)
    "2": [0.25043, 0.25050, 0.25049, 0.25055],
    "4": [0.25101, 0.25044, 0.25082, 0.25158],
    "5": [0.25161, 0.25068, 0.25092, 0.25190],
    "8": [0.25147, 0.25106, 0.25140, 0.25136],
}


def test_reference_plot_keeps_layers_apart_when_they_all_sit_at_one_value(monkeypatch):
    """Not equal to three digits, so they were drawn on top of each other: one line, three of four layers hidden."""
    plots, figs = _figures(monkeypatch)
    plots.reference_margin(DEMO_MARGINS, 4)
    ax = figs[0].axes[0]
    layer_lines = [line for line in ax.lines if line.get_label().startswith("layer ")]
    xs = [tuple(line.get_xdata()) for line in layer_lines]
    assert len(layer_lines) == 4 and len(set(xs)) == 4  # side by side: each visible
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("layers 2, 4, 5, 8: 0.250–0.252") for t in labels), labels


def test_layers_far_apart_are_not_moved(monkeypatch):
    plots, figs = _figures(monkeypatch)
    plots.reference_margin({"2": [0.25, 0.3], "4": [0.6, 0.7]}, 2)
    xs = {tuple(line.get_xdata()) for line in figs[0].axes[0].lines if line.get_label().startswith("layer ")}
    assert xs == {(0, 1)}


def test_length_legend_counts_the_rows_its_bar_holds(monkeypatch):
    """The red bar holds every row at max_seq_len; the legend said "25 rows cut to it" over a bar of 27 (two rows
    were exactly max_seq_len long, not cut)."""
    import pandas as pd

    plots, figs = _figures(monkeypatch)
    rows = pd.DataFrame({"seq_len": [40, 60, 90, 127, 128, 128, 128], "mask_share": [0.5] * 7})
    plots.distributions(rows, 128, truncated_rows=2)
    ax = figs[0].axes[0]
    [cap] = [p for p in ax.patches if p.get_height() > 0 and p.get_x() >= 128]
    [label] = [t.get_text() for t in ax.get_legend().get_texts() if t.get_text().startswith("at max_seq_len")]
    assert cap.get_height() == 3 and label == "at max_seq_len: 3 rows (2 cut to it)"


def _provenance_ctx(reports):
    from eagle3prep.report import data

    return {
        "dataset": {"model": {}, "tokenizer": {}, "engine": {}, "dtype": "bfloat16", "hidden_size": 128,
                    "num_hidden_layers": 8, "sources": ["a.jsonl"]},
        "stats": {}, "export": None, "code_versions": {"1"}, "reports": reports,
        "reference_line": data.reference_summary(reports),
    }  # fmt: skip


def test_provenance_names_the_reference_run_and_the_floor_run():
    """It said "54 of 91 rows recomputed with transformers bfloat16 on cpu": the floor run, under "validation
    reference", and no word of the float32 reference every capture is compared with."""
    from eagle3prep.report import page

    sample = {"rows": 54, "of": 91, "miss_probability": 0.009}
    v = {"reference_mode": "full", "reference_sample": sample, "reference_floor": "transformers bfloat16 on cpu"}
    rows = dict(re.findall(r"<tr><td class='l'>([^<]*)</td><td class='l'>(.*?)</td></tr>", page.provenance_table(
        _provenance_ctx([v]))))  # fmt: skip
    assert rows["validation reference"].startswith("transformers float32 on cpu (exact): 54 of 91 rows recomputed")
    assert rows["validation floor run"].startswith("transformers bfloat16 on cpu: the same forward at the capture")
    exact = {**v, "reference_floor": "none (fp32 on a CPU: the reference is exact)"}  # an fp32 capture on a CPU
    rows = dict(re.findall(r"<tr><td class='l'>([^<]*)</td><td class='l'>(.*?)</td></tr>", page.provenance_table(
        _provenance_ctx([exact]))))  # fmt: skip
    assert rows["validation reference"].startswith("transformers float32 on cpu (exact)")
    assert rows["validation floor run"].startswith("none (fp32 on a CPU: the reference is exact)")


def _write_quarantine(path: Path, entries: list[tuple[str, str, str]]) -> None:
    """Quarantine lines of (reason, detail, the conversation's source "file:line")."""
    lines = [
        {"file": "conversations.jsonl", "line": i + 1, "reason": r, "detail": d, "record": {"id": "x", "source": s}}
        for i, (r, d, s) in enumerate(entries)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _counts(files: list[dict]) -> dict:
    totals = {k: sum(f[k] for f in files) for k in ("rows_in", "kept", "duplicates")}
    reasons = {r for f in files for r in f["quarantined"]}
    totals["quarantined"] = {r: sum(f["quarantined"].get(r, 0) for f in files) for r in sorted(reasons)}
    return {"files": files, "totals": {**totals, "files": len(files)}}


TOOL_DETAIL = "the chat template does not render tool turns: the call's name, its arguments"


def test_rows_lost_per_source_file(tmp_path):
    """A run of several sources told only the totals: which file lost its rows, and why, was not on the page."""
    from eagle3prep.report import tables

    counts = _counts([
        {"file": "a.jsonl", "rows_in": 10, "kept": 7, "duplicates": 1, "quarantined": {"invalid_json": 2}},
        {"file": "tools.jsonl", "rows_in": 5, "kept": 5, "duplicates": 0, "quarantined": {"invalid_json": 0}},
    ])  # fmt: skip
    quarantine = tmp_path / "quarantine.jsonl"
    _write_quarantine(quarantine, [("no_assistant_tokens", "cut", "a.jsonl:3")]
                      + [("tool_turns_unsupported_by_template", TOOL_DETAIL, f"tools.jsonl:{i}") for i in (1, 2, 4)])  # fmt: skip
    rows = rd.source_losses(counts, {"tokenize": rd.quarantine_facts(quarantine)})
    assert rows == [
        {"file": "a.jsonl", "rows_in": 10, "duplicates": 1, "lost": {"prepare": {"invalid_json": 2},
                                                                      "tokenize": {"no_assistant_tokens": 1}}, "rows_out": 6},
        {"file": "tools.jsonl", "rows_in": 5, "duplicates": 0,
         "lost": {"prepare": {}, "tokenize": {"tool_turns_unsupported_by_template": 3}}, "rows_out": 2},
    ]  # fmt: skip
    html = tables.source_table(rows)
    assert "<td class='l'>tools.jsonl</td><td>5</td><td>0</td><td class='l'></td>" in html
    assert "tool_turns_unsupported_by_template 3</td><td>2</td>" in html


def test_a_banner_says_how_many_tool_call_conversations_were_quarantined_and_why(tmp_path):
    from eagle3prep.report import page, tables

    quarantine = tmp_path / "quarantine.jsonl"
    _write_quarantine(
        quarantine, [("tool_turns_unsupported_by_template", TOOL_DETAIL, f"t.jsonl:{i}") for i in (1, 2, 3)]
    )
    counts = {"totals": {"quarantined": {"invalid_tool_call": 1, "invalid_json": 4}}}
    stats = {"quarantined": {"tool_turns_unsupported_by_template": 3, "no_assistant_tokens": 2}}
    tools = rd.tool_quarantine(counts, stats, {"tokenize": rd.quarantine_facts(quarantine)})
    assert tools == {"total": 4, "stages": [
        ("prepare", "invalid_tool_call", 1, None),
        ("tokenize", "tool_turns_unsupported_by_template", 3, ("t.jsonl:1", TOOL_DETAIL)),
    ]}  # fmt: skip
    ctx = {"reference_skipped": [], "reports": [], "margins": {}, "tool_quarantine": tools}
    [banner] = [b for b in page.banners(ctx) if "tool calls" in b]
    assert banner.startswith("<div class='banner warn'>4 conversations with tool calls were quarantined")
    assert (
        f"3 by tokenize as tool_turns_unsupported_by_template ({html.escape(TOOL_DETAIL)}; the first from t.jsonl:1)"
        in banner
    )
    assert "1 by prepare as invalid_tool_call (a tool call without a function name" in banner
    one = {"total": 1, "stages": [("prepare", "invalid_tool_call", 1, None)]}
    assert "1 conversation with tool calls was quarantined" in tables.tool_banner(one)[0]
    assert rd.tool_quarantine({"totals": {"quarantined": {}}}, {"quarantined": {}}, {}) is None


def test_values_at_zero_are_not_cut_by_the_axis(monkeypatch):
    """A layer at 0 (the capture equal to the reference; no outlier token) sat on the x axis, its marker cut in half:
    the flat line read as no data. Both plots leave a margin below 0."""
    plots, figs = _figures(monkeypatch)
    zero = {lid: [0.0, 0.0, 0.0] for lid in ("2", "4", "5", "8")}
    plots.reference_margin(zero, 3)
    plots.layer_stats({"mean": zero, "std": zero, "max_abs": zero, "outlier_share": zero}, 3)
    reference, outliers = figs[0].axes[0], figs[1].axes[3]
    for ax in (reference, outliers):
        bottom, top = ax.get_ylim()
        assert -0.1 * top < bottom < 0 < top
    assert reference.get_ylim()[1] == 1.2  # the bound stays in view
