"""Progress where the user looks (eagle3prep.run.progress): each running extract job's tokens/s, share done and ETA,
read from the bar its log holds."""

import io
import os
import sys
import time
from pathlib import Path

import pytest
from tqdm import tqdm

from eagle3prep.run import progress


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def extract_log(k: int, done: int, total: int = 2000) -> Path:
    """A log as the extract job writes it: its first line, then tqdm's bar, rewritten with carriage returns."""
    log = Path(progress.EXTRACT_LOG.format(k=k))
    log.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    bar = tqdm(total=total, unit="tok", unit_scale=True, file=buf, mininterval=0, desc=f"shard {k}")
    for _ in range(done // 100):
        bar.update(100)
    log.write_text(f"[extract] shard {k}: 9 rows, {total} tokens\n" + buf.getvalue())
    return log


def test_a_running_job_shows_its_share_rate_and_eta():
    extract_log(3, done=900)
    [p] = progress.running([3], within_s=60)
    assert (p.shard, p.percent, p.total) == (3, 45, "2.00k") and p.eta != ""
    line = p.line()
    assert line.startswith("extract shard_3: 45% of 2.00k tokens, ") and "tokens/s, ETA " in line


def test_finished_stale_and_starting_jobs():
    extract_log(0, done=500)
    Path("results/hidden_states/shard_0").mkdir(parents=True)
    Path(progress.MANIFEST_OF.format(k=0)).write_text("{}")  # finished
    old = extract_log(1, done=500)
    past = time.time() - 3600
    os.utime(old, (past, past))  # a log from an earlier run
    Path(progress.EXTRACT_LOG.format(k=2)).write_text("loading weights\n")  # engine starting
    assert progress.lines(range(3), within_s=60) == ["extract shard_2: starting its engine (logs/extract/shard_2.log)"]


def test_the_thread_prints_at_its_interval_and_can_be_turned_off():
    extract_log(1, done=300)
    seen = []
    progress.start([1], interval=0.05, emit=seen.append)
    time.sleep(0.3)
    assert seen and seen[0].startswith("extract shard_1: 15% of 2.00k tokens")
    assert progress.start([1], interval=0) is None
    assert progress.interval_s({"EAGLE3PREP_PROGRESS_S": "0"}) == 0
    assert progress.interval_s({}) == progress.INTERVAL_S


def regenerate_log(k: int, done: int, total: int = 40, slow: bool = False) -> Path:
    """A log as the regenerate job writes it (regenerate.stage._write_results): a bar of conversations."""
    log = Path(progress.REGENERATE.log.format(k=k))
    log.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    bar = tqdm(total=total, unit="conv", file=buf, mininterval=0, desc=f"shard {k}")
    for _ in range(done):
        bar.update(1)
    text = buf.getvalue()
    if slow:  # under one conversation a second tqdm writes the inverse
        text += f"\rshard {k}:  50%|#####     | 20/40 [04:10<04:10, 12.50s/conv]"
    log.write_text(f"starting vLLM 0.34.0: {{}}\n{text}")
    return log


def test_running_regenerate_jobs_show_their_conversations_share_rate_and_eta():
    """Before: only extract jobs had a line; the regenerate stage's GPU jobs were silent on the terminal."""
    regenerate_log(0, done=10)
    regenerate_log(1, done=20, slow=True)
    Path(progress.REGENERATE.log.format(k=2)).write_text("starting vLLM 0.34.0\n")  # engine starting
    regenerate_log(3, done=40)
    Path("results/regenerate/shard_3").mkdir(parents=True)
    Path(progress.REGENERATE.manifest.format(k=3)).write_text("{}")  # finished
    extract_log(0, done=900)
    out = progress.lines([0], within_s=60, regenerate_shards=range(4))
    assert len(out) == 4, out
    assert out[0].startswith("regenerate shard_0: 25% of 40 conversations, ") and "conversations/s, ETA " in out[0]
    assert out[0].endswith("(logs/regenerate/shard_0.log)")
    assert out[1] == "regenerate shard_1: 50% of 40 conversations, 0.08 conversations/s, ETA 04:10 " \
        "(logs/regenerate/shard_1.log)"  # fmt: skip
    assert out[2] == "regenerate shard_2: starting its engine (logs/regenerate/shard_2.log)"
    assert out[3].startswith("extract shard_0: 45% of 2.00k tokens")
    seen = []
    progress.start([], interval=0.05, emit=seen.append, regenerate_shards=[0])
    time.sleep(0.3)
    assert seen and seen[0].startswith("regenerate shard_0: 25% of 40 conversations")


def test_the_regenerate_jobs_own_bar_is_read(monkeypatch, tmp_path):
    """The bar regenerate.stage writes into its job's log (its unit and description) is the one the line reads."""
    from types import SimpleNamespace

    from eagle3prep.regenerate import stage

    log = Path(progress.REGENERATE.log.format(k=5))
    log.parent.mkdir(parents=True)
    rows = [SimpleNamespace(to_json=lambda: {"messages": []}) for _ in range(6)]
    out = tmp_path / "shard_5"
    out.mkdir()
    with log.open("w") as f:
        monkeypatch.setattr(sys, "stderr", f)
        stage._write_results(out, iter(rows), rows=8, shard=5)
    [line] = progress.lines([], within_s=60, regenerate_shards=[5])
    assert line.startswith("regenerate shard_5: 75% of 8 conversations, ") and "conversations/s, ETA " in line
