"""Healing does not depend on Snakemake's metadata: a finished demo results folder copied elsewhere, moved, or with
`.snakemake/` deleted heals through real `snakemake` runs exactly as it would in place. Each folder gets the three
kinds of damage at once: (a) a byte flipped through a rename (the folder's date moves), (b) a byte written in place
with the folder's date put back (only the file's size and mtime that validation recorded tell), (c) a byte flipped
with every date put back, which only `snakemake verify` finds and records.

Before: the copied and metadata-less folders printed "validating it again" / "extracting it again", then Snakemake
said "Nothing to be done" and the run exited 0 over damaged data; (b) was not noticed at all. The copied folder
is taken on to the run that sets the failed shards aside and ends with exit status 0 and the finished run's bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3prep.healing import heal
from eagle3prep.report import stale

from testkit.workflow import snakemake

LAYER = "layer_4.safetensors"


def place(finished: Path, tmp_path: Path, kind: str) -> Path:
    """The finished folder, copied (dates kept, no `.snakemake/`), moved (all of it, to another path) or with its
    `.snakemake/` deleted."""
    if kind == "copied":
        return shutil.copytree(finished, tmp_path / "copy", symlinks=True, ignore=shutil.ignore_patterns(".snakemake"))
    wd = shutil.copytree(finished, tmp_path / "wd", symlinks=True)
    if kind == "moved":
        (tmp_path / "elsewhere").mkdir()
        return Path(shutil.move(wd, tmp_path / "elsewhere" / "results_folder"))
    shutil.rmtree(wd / ".snakemake")
    return wd


def flip(path: Path, at: int = -8) -> None:
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_END)
        byte = f.read(1)
        f.seek(at, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def damage(wd: Path) -> None:
    shards = [wd / heal.shard_dir(k) for k in range(3)]
    # (c) shard 2: every date put back; only verify's checksums find it, and it records what it found.
    dates = {p: p.stat().st_mtime_ns for p in (shards[2], shards[2] / LAYER)}
    flip(shards[2] / LAYER)
    for p, ns in dates.items():
        os.utime(p, ns=(ns, ns))
    assert snakemake(wd, "verify", check=False).returncode != 0
    # (a) shard 0: written through a rename, as an editor does: the folder's date moves.
    data = bytearray((shards[0] / LAYER).read_bytes())
    data[-8] ^= 0xFF
    (shards[0] / "tmp").write_bytes(bytes(data))
    os.replace(shards[0] / "tmp", shards[0] / LAYER)
    # (b) shard 1: a byte written in place, the folder's date put back.
    folder_ns = shards[1].stat().st_mtime_ns
    flip(shards[1] / LAYER, at=-16)
    os.utime(shards[1], ns=(folder_ns, folder_ns))


def same_bytes(wd: Path, finished: Path, k: int) -> bool:
    return (wd / heal.shard_dir(k) / LAYER).read_bytes() == (finished / heal.shard_dir(k) / LAYER).read_bytes()


@pytest.mark.parametrize("kind", ["copied", "moved", "no_metadata"])
def test_a_damaged_folder_heals_wherever_it_is_and_with_or_without_metadata(small_demo_run, tmp_path, kind):
    wd = place(small_demo_run, tmp_path, kind)
    damage(wd)
    if kind == "copied":  # -n lists what the run will redo, and leaves no ticket behind
        dry = snakemake(wd, "-n")
        said = dry.stdout + dry.stderr
        assert "Nothing to be done" not in said
        assert said.count("reason: Updated input files: .eagle3prep/heal/1.json") == 3, said[-3000:]
        assert not (wd / ".eagle3prep/heal/1.json").exists()

    first = snakemake(wd, check=False)
    err = first.stdout + first.stderr
    # What healing says it redoes is what runs: never "Nothing to be done" and exit 0 over damaged data.
    assert first.returncode != 0 and "Nothing to be done" not in err, err[-3000:]
    assert f"{heal.shard_dir(0)} changed after {heal.validation_json(0)} was written: validating it again" in err
    assert f"{heal.shard_dir(1)}: {LAYER} was written again (its mtime is not the one validated)" in err
    assert f"{heal.shard_dir(2)}: shard_2/{LAYER}: sha256" in err and "(results/verify.json): extracting it" in err
    for k in (0, 1):  # validated again: each fails naming its shard and file
        assert f"error: {heal.shard_dir(k)}: 1 check(s) failed: file:{LAYER}" in err, err[-3000:]
    assert (wd / heal.validation_json(2)).exists()  # extracted again, and it passed
    assert same_bytes(wd, small_demo_run, 2)
    assert stale.is_stale(wd / stale.REPORT)
    if kind != "copied":
        return  # what follows (set aside, extracted again) no longer depends on where the folder is

    second = snakemake(wd, check=False)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    for k in (0, 1):  # set aside, extracted again: the bytes the finished run made
        assert (wd / f"results/failed/shard_{k}/hidden_states/{LAYER}").exists()
        assert same_bytes(wd, small_demo_run, k)
    assert not stale.is_stale(wd / stale.REPORT)
    again = snakemake(wd, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr


TICKET_BY_A_JOB = """
import os
rule all:
    input: "out.txt"
rule heal:
    output: "ticket.json"
    shell: "echo '{{}}' > {output}"
rule work:
    input: lambda w: ["ticket.json"] if os.path.exists("due") else []
    output: "out.txt"
    shell: "date > {output}"
"""


@pytest.mark.parametrize("metadata", [True, False], ids=["with .snakemake", "without"])
def test_why_the_ticket_is_written_while_the_snakefile_is_read(tmp_path, metadata):
    """A ticket made by a job of its own redoes the due job only where Snakemake's metadata is: without it
    Snakemake says "Nothing to be done" over a missing ticket whose consumer's output is there. So healing writes
    its ticket while the Snakefile is read (healing.tickets.Healing.prepare), newer than the due jobs' outputs."""
    (tmp_path / "Snakefile").write_text(TICKET_BY_A_JOB)
    cmd = [str(Path(sys.executable).with_name("snakemake")), "-c1", "--workflow-profile", "none"]
    assert subprocess.run(cmd, cwd=tmp_path, capture_output=True).returncode == 0
    if not metadata:
        shutil.rmtree(tmp_path / ".snakemake")
    (tmp_path / "due").touch()
    dry = subprocess.run([*cmd, "-n"], cwd=tmp_path, capture_output=True, text=True)
    assert dry.returncode == 0
    redone = "Input files updated by another job: ticket.json" in dry.stdout + dry.stderr
    assert redone == metadata
