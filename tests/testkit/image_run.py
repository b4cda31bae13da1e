"""A finished run of conversations with images, in the workflow's results/ layout, for the stages after extract
(issue #28 item 6): prepare and tokenize with the tiny Qwen2.5-VL, then shards of random states written by the
test writer (extract cannot take image rows on this branch) and their validations (files, not the reference).

Its conversations: resources/demo/vision.jsonl (5 kept with 6 images, and records prepare quarantines for their
images), TEXT_ROWS text-only ones, and one whose image changes after prepare (tokenize quarantines it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from testkit import calls
from testkit.shards import write_shard_of

REPO = Path(__file__).resolve().parents[2]
LAYER_IDS = [1, 3, 5, 6]  # three auxiliary layers and N = 6 of the tiny VL target (its default repeats id 3)
NUM_SHARDS = 2
TEXT_ROWS = 3
CHANGED = {"messages": [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "changing.png"}},
                                 {"type": "text", "text": "What is it?"}]},
    {"role": "assistant", "content": "A circle."}]}  # fmt: skip


def _text_record(k: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Question {k}: what is {k} plus {k}?"},
                         {"role": "assistant", "content": f"It is {2 * k}, the sum of {k} and {k}."}]}  # fmt: skip


def build_image_run(wd: Path, model: Path) -> Path:
    """`wd`/results/ as a finished run with images leaves it (without report and export); returns `wd`."""
    res, images = wd / "results", wd / "images"
    shutil.copytree(REPO / "resources/demo/images", images)
    shutil.copy(images / "blue_circle.png", images / "changing.png")
    lines = (REPO / "resources/demo/vision.jsonl").read_text(encoding="utf-8").splitlines()
    # text rows between the image rows, so that both shards hold both kinds
    records = [json.loads(x) for x in lines[:3]] + [_text_record(k) for k in range(TEXT_ROWS)]
    records += [json.loads(x) for x in lines[3:]] + [CHANGED]
    src = wd / "sources.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    p, t = res / "prepared", res / "tokenized"
    calls.prepare(
        [str(src)],
        p / "conversations.jsonl",
        p / "quarantine.jsonl",
        p / "counts.json",
        images=calls.image_options(images),
    )
    shutil.copy(images / "red_square.png", images / "changing.png")  # not the image prepare read any more
    shards = [t / f"shard_{k}.jsonl" for k in range(NUM_SHARDS)]
    calls.tokenize(
        p / "conversations.jsonl", model, shards, t / "stats.json", t / "token_freq.json", t / "quarantine.jsonl", 256
    )
    for k, tok in enumerate(shards):
        shard = write_shard_of(tok, res / f"hidden_states/shard_{k}", model, LAYER_IDS, seed=k)
        calls.validate(shard, tok, res / f"validation/shard_{k}.json", model, reference=False)
    return wd


def report_inputs(wd: Path, out: Path, model: Path) -> dict:
    """run_report_job's paths on the run (no benchmark files: the throughput cells stay empty)."""
    k = range(NUM_SHARDS)
    res = wd / "results"
    return dict(
        validations=[str(res / f"validation/shard_{i}.json") for i in k],
        shard_dirs=[str(res / f"hidden_states/shard_{i}") for i in k],
        tokenized=[str(res / f"tokenized/shard_{i}.jsonl") for i in k],
        counts_path=str(res / "prepared/counts.json"),
        stats_path=str(res / "tokenized/stats.json"),
        token_freq_path=str(res / "tokenized/token_freq.json"),
        benchmarks=[str(wd / f"benchmarks/extract/shard_{i}.tsv") for i in k],
        out_html=str(out / "report.html"),
        out_csv=str(out / "summary.csv"),
        out_manifest=str(out / "dataset_manifest.json"),
        model_dir=str(model),
    )
