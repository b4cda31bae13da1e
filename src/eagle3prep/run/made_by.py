"""A results folder remembers the config that made it (results/config.json), so that a run which would extract
its finished shards again with another model, other sources or other layer ids (a forgotten --configfile, the
demo's config, a second --configfile) is refused when the workflow is parsed, in one line naming both configs.

Only those keys count: Snakemake redoes every shard when one of them changes (an input or a param of the chain
prepare -> tokenize -> extract), and they decide what the dataset is. A change that only adds work (turning the
export on) or that the user makes on purpose to a shard's bytes (extract.dtype) is not refused. The record is
written when a run (not a dry run) builds its DAG, with the same bytes whenever the config is the same, and is never
read by a job; `replace_results: true` lets one run replace the shards of another config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..settings import Settings
from .command import Command

RECORD = "results/config.json"
HIDDEN_STATES = "results/hidden_states"  # as heal.HIDDEN_STATES
MANIFEST = "manifest.json"  # shard.MANIFEST; not imported, to keep torch out of the Snakefile's parse
REPLACE = "replace_results"  # the config key that lets a run replace another config's shards
IDENTITY = ("model.path", "data.sources", "layers")


def identity(settings: Settings) -> dict[str, Any]:
    """The values of the IDENTITY keys in a validated config, as the rules pass them to Snakemake."""
    return {
        "model.path": settings.model.path,
        "data.sources": list(settings.data.sources),
        "layers": {"ids": settings.layers.ids, "convention": settings.layers.convention},
    }


# The keys whose change makes Snakemake extract every finished shard again: each is a param (or an input) of a job
# in the chain prepare -> tokenize -> extract (the rules' params), so a new value re-queues the chain's jobs.
SHARD_KEYS = {
    "data": ("sources", "max_line_bytes", "allow_no_user_turn", "image_root", "max_image_pixels"),
    "model": ("path", "trust_remote_code"),
    "layers": ("ids", "convention"),
    "tokenize": ("max_seq_len", "num_shards", "template_fallback", "chat_template_kwargs"),
}


def shard_keys(config: dict[str, Any]) -> dict[str, Any]:
    """{dotted key: value} of what decides the finished shards' bytes, from a validated config (the extract rule's
    params for extract.*)."""
    from ..settings import ExtractSettings

    keys = {f"{sec}.{k}": config.get(sec, {}).get(k) for sec, names in SHARD_KEYS.items() for k in names}
    keys |= {f"extract.{k}": v for k, v in ExtractSettings.params(config).items()}
    return json.loads(json.dumps(keys, default=str))  # as the record reads it back (lists, not tuples)


def record(settings: Settings, config_files: list[str], keys: dict[str, Any] | None = None) -> dict[str, Any]:
    """What results/config.json holds: the config files as shown to the user (relative to the working directory
    when under it), the identity of the config they made and, when given, its shard_keys."""
    return {
        "config_files": list(config_files),
        "identity": identity(settings),
        **({"shard_keys": keys} if keys else {}),
    }


def redo_note(keys: dict[str, Any], shards: list[int], record_path: str | os.PathLike = RECORD,
              shard_root: str | os.PathLike = HIDDEN_STATES) -> str | None:  # fmt: skip
    """The one line that says a config change will extract finished shards again, naming the keys and the count;
    None when no shard key changed or no shard of this config is finished."""
    old = (read_record(record_path) or {}).get("shard_keys")
    if not isinstance(old, dict):
        return None
    changed = [k for k in keys if k in old and old[k] != keys[k]]
    if not changed:
        return None
    n = sum(os.path.isfile(os.path.join(shard_root, f"shard_{k}", MANIFEST)) for k in shards)
    if not n:
        return None
    what = ", ".join(f"{k} {_short(old[k])} -> {_short(keys[k])}" for k in changed[:3])
    what += f" (and {len(changed) - 3} more keys)" if len(changed) > 3 else ""
    return (
        f"config change: {what} since the last run: {n} finished shard{'s' * (n != 1)} will be extracted (and "
        "validated) again; put the old value back to keep them"
    )


def read_record(path: str | os.PathLike = RECORD) -> dict[str, Any] | None:
    """The record, or None when there is none or it cannot be read (then nothing is refused)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and isinstance(data.get("identity"), dict):
        return data
    return None


def write_record(settings: Settings, config_files: list[str], path: str | os.PathLike = RECORD,
                 keys: dict[str, Any] | None = None) -> bool:  # fmt: skip
    """Write the record when it differs from the one on disk (an unchanged file keeps its date); True if written."""
    text = json.dumps(record(settings, config_files, keys), indent=1, sort_keys=True) + "\n"
    path = Path(path)
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except OSError:
        pass
    from ..infra.atomic import atomic_open

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return True


def finished_shards(hidden_states: str | os.PathLike = HIDDEN_STATES) -> int:
    """Shard folders with a manifest (one listing, one stat each)."""
    try:
        with os.scandir(hidden_states) as entries:
            names = [e.name for e in entries if e.name.startswith("shard_") and e.is_dir()]
    except FileNotFoundError:
        return 0
    return sum(os.path.isfile(os.path.join(hidden_states, n, MANIFEST)) for n in names)


def _short(value: Any) -> str:
    """A value for the one-line message: long lists cut to their first two items."""
    if isinstance(value, list) and len(value) > 2:
        return "[" + ", ".join(str(v) for v in value[:2]) + f", +{len(value) - 2} more]"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, dict):
        # layers.ids None is the model's default set ([2, N//2, N-3, N]), not an absent value
        return "{" + ", ".join(f"{k}: {'default' if v is None else _short(v)}" for k, v in value.items()) + "}"
    return str(value)


def _files(files: list[str], demo: bool = False) -> str:
    if not files:
        return "an unnamed config"
    return " + ".join(files) + (" (the demo's, read because no --configfile was given)" if demo else "")


def check(
    settings: Settings,
    config_files: list[str],
    demo: bool,
    command: Command | None = None,
    record_path: str | os.PathLike = RECORD,
    hidden_states: str | os.PathLike = HIDDEN_STATES,
) -> tuple[str | None, str | None]:
    """(error, note): the one line that refuses this run, or the note that it replaces another config's shards
    (config key REPLACE); (None, None) when the folder holds no finished shard of another config.
    `config_files`: this run's, as shown; `demo`: none was given and the demo's config/config.yaml is read;
    `command`: the user's, for the two commands the line suggests."""
    old = read_record(record_path)
    if old is None:
        return None, None
    now = identity(settings)
    differ = [k for k in IDENTITY if old["identity"].get(k) != now[k]]
    if not differ:
        return None, None
    n = finished_shards(hidden_states)
    if not n:
        return None, None
    theirs = _files(old.get("config_files") or [])
    what = "; ".join(f"{k} {_short(old['identity'].get(k))} there, {_short(now[k])} here" for k in differ)
    shards = f"{n} finished shard{'s' if n != 1 else ''}"
    if settings.replace_results:
        return None, f"{REPLACE}: replacing the {shards} of {theirs} in results/ ({what})"
    command = command or Command()
    ways = []
    recorded = old.get("config_files") or []
    if recorded and recorded != list(config_files):
        # The config that made the shards: the likeliest fix for a forgotten or wrong --configfile.
        theirs_command = command.setting("--configfile", *[f for f in recorded if f != "--config"])
        ways.append(f"run with the config that made them: {theirs_command}")
    ways.append(f"run this config in another folder: {command.setting('--directory', 'OTHER_FOLDER')}")
    if not demo:
        # Only the user's own config may replace the shards: the demo's, read for a forgotten --configfile,
        # would extract them again with the demo's model and sources.
        replace = command.adding("--config", f"{REPLACE}=true")
        ways.append(f"or replace them with this config: {replace} (or {REPLACE}: true in the config)")
    return (
        f"config error: results/ holds {shards} and was last run with {theirs}; this run's config "
        f"{_files(config_files, demo)} differs in {what}, so it would extract them again. "
        + "; ".join(w[0].upper() + w[1:] if i == 0 else w for i, w in enumerate(ways)),
        None,
    )
