"""Progress where the user looks (eagle3prep.run.progress): each running extract job's tokens/s, share done and ETA,
read from the bar its log holds."""

import io
import os
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
