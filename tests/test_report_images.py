"""The report of a run with images (issue #28 item 6): rows with images, images per row, the vision tokens'
share and each stage's image quarantine reasons; a run without images gets nothing new."""

from __future__ import annotations

from eagle3prep.prepare.errors import IMAGE_REASONS
from eagle3prep.report import ReportJobSettings, ReportPaths, page, run_report_job
from eagle3prep.report import data as rd
from eagle3prep.tokenize.vision import UNSUPPORTED

from testkit.image_run import report_inputs


def test_the_report_of_a_run_with_images_shows_them(image_run, tiny_vl_dir, tmp_path):
    dataset = run_report_job(ReportPaths(**report_inputs(image_run, tmp_path, tiny_vl_dir)), ReportJobSettings())
    html = (tmp_path / "report.html").read_text()
    section = html.split("<h2>Images</h2>")[1].split("<h2>")[0]
    # tests/testkit/image_run.py: 8 rows, 5 with 6 images (one with two), 36 of 398 tokens are vision tokens
    assert "5 of 8 (62.5%)" in section and "6 (1.20 per image row; prepare kept 7)" in section
    assert "0: 3 rows · 1: 4 rows · 2: 1 row" in section
    assert "36 (9.0% of all tokens)" in section
    # prepare's image reasons (resources/demo/vision.jsonl's bad records), then tokenize's (an image changed)
    assert "image_count_mismatch 1, image_missing 1, image_remote_url 1, image_unreadable 1" in section
    assert "quarantined for images by tokenize</td><td class='l'>image_changed 1" in section
    # before the validation grid: on the first screen with the row funnel
    assert html.index("<h2>Images</h2>") < html.index("<h2>Validation")
    assert dataset["tokenize"]["image_rows"] == 5 and dataset["prepare"]["images"] == 7


def test_a_run_without_images_gets_no_image_part():
    counts = {"totals": {"rows_in": 4, "duplicates": 0, "kept": 4, "quarantined": {"no_user_turn": 0}}}
    stats = {"rows": 4, "tokens": 100, "quarantined": {}}
    assert rd.image_facts(counts, stats, [0, 0, 0, 0]) is None
    assert page.images_section(None) == []  # not even an empty line in the page


def test_image_quarantine_reasons_of_both_stages_are_found_by_their_prefix():
    """image_facts picks a stage's image reasons by name: every one either stage writes must carry the prefix."""
    tokenize_reasons = (UNSUPPORTED, "image_missing", "image_changed", "image_cut_by_max_seq_len")
    assert all(r.startswith("image") for r in (*IMAGE_REASONS, *tokenize_reasons))
    counts = {"totals": {"images": 3, "quarantined": {"image_missing": 2, "no_user_turn": 5, "image_too_large": 0}}}
    stats = {"rows": 2, "quarantined": {UNSUPPORTED: 1, "no_assistant_tokens": 4}}
    facts = rd.image_facts(counts, stats, [0, 0])
    assert facts["quarantined"] == {"prepare": {"image_missing": 2}, "tokenize": {UNSUPPORTED: 1}}
    assert facts["image_rows"] == 0 and facts["rows_by_images"] == {0: 2}  # a text-only target kept no image row
    html = "".join(page.images_section(facts))
    assert "0 of 2 (0.0%)" in html and "0 (0 per image row; prepare kept 3)" in html
