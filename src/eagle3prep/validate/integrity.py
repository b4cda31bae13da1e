"""Integrity checks: the manifest, every file it lists (size and sha256), no stray files, one layer file per
layer id, and the index against the tokenized shard it was captured from (DESIGN.md §6)."""

from __future__ import annotations

from pathlib import Path

from ..check import Checks
from ..shard.manifest import ShardManifest, check_listed_file, read_manifest, stray_files
from ..shard.shardset import Tokenized, open_shard, shard_checks
from .subject import ShardUnderTest


def check_manifest(shard_dir: str, checks: Checks) -> ShardManifest | None:
    """The shard's manifest, or None (and a failed `manifest` check) when it is missing or unreadable."""
    try:
        m = read_manifest(shard_dir)
    except (FileNotFoundError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        checks.add("manifest", False, str(e))
        return None
    checks.add("manifest", True)
    return m


def check_files(shard: Path, manifest: ShardManifest, checks: Checks) -> bool:
    ok = True
    for name, entry in sorted(manifest.files.items()):
        ok &= checks.add(f"file:{name}", *check_listed_file(shard / name, entry))
    stray = stray_files(shard, set(manifest.files))
    ok &= checks.add("no_stray_files", not stray, f"unexpected files: {stray}" if stray else "")
    ok &= checks.add("layer_files", *manifest.layer_files_match())
    return ok


def check_intact(
    shard_dir: Path, manifest: ShardManifest, tokenized: Tokenized, checks: Checks
) -> ShardUnderTest | None:
    """The files, then the index against the tokenized shard (shardset.shard_checks): the shard opened for the
    content checks, or None when any failed. The index is read only once index.json's sha256 matched."""
    if not check_files(shard_dir, manifest, checks):
        return None
    shard = open_shard(shard_dir, tokenized, manifest)
    return ShardUnderTest(shard) if checks.extend(shard_checks(shard)) else None
