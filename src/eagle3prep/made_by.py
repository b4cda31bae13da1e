"""A results folder remembers the config that made it (results/config.json), so that a run which would extract
its finished shards again is refused when the workflow is parsed, in one line: another model, other sources or
other layer ids (a forgotten --configfile, the demo's config, a second --configfile) name both configs; any other
key that decides a shard's bytes (CONTENT_KEYS, the params and inputs of the chain prepare -> regenerate ->
tokenize -> extract) names the key, the shards and about how many GPU-hours they took, by their timings.json.

A change that only adds work (turning the export on) or decides no byte (a speed knob, the report) is not refused;
`replace_results: true` accepts the change and replaces the shards. The record is written when a run that holds
shard jobs starts (Snakemake's onstart: not in a dry run, `plan`, `verify` or a refused run), with the same bytes
whenever the config is the same, and is never read by a job.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import paths
from .config.schema import SCALABLE_LOGPROB_ROWS
from .infra.units import human_duration
from .paths import HIDDEN_STATES, MANIFEST, PREPARED, TOKENIZED
from .run.command import Command
from .settings import Settings

RECORD = paths.CONFIG_RECORD
PLAN_SCRATCH = paths.PLAN_DIR  # what `plan` makes for another config than results/'s
REPLACE = "replace_results"  # the config key that lets a run replace another config's shards
IDENTITY = ("model.path", "data.sources", "layers")


def identity(settings: Settings) -> dict[str, Any]:
    """The values of the IDENTITY keys in a validated config, as the rules pass them to Snakemake."""
    return {
        "model.path": settings.model.path,
        "data.sources": list(settings.data.sources),
        "layers": {"ids": settings.layers.ids, "convention": settings.layers.convention},
    }


# The keys whose change makes Snakemake extract every finished shard again: each is a param (or an input) of a job in
# the chain prepare -> (regenerate) -> tokenize -> extract, so a new value re-queues the chain's jobs. Beside these:
# extract's content keys (ExtractSettings.params), and regenerate's (RegenerateSettings.params) while the stage is on.
# tests/test_made_by.py reads the rules' params and holds this set to them.
CONTENT_KEYS = {
    "data": ("sources", "max_line_bytes", "allow_no_user_turn", "image_root", "max_image_pixels"),
    "model": ("path", "trust_remote_code"),
    "layers": ("ids", "convention"),
    "tokenize": ("max_seq_len", "num_shards", "template_fallback", "chat_template_kwargs"),
}
# The keys of the tokenized shards (what `plan` may read from results/tokenized when they are the same).
TOKEN_SECTIONS = ("data", "model", "tokenize", "regenerate")


def shard_keys(config: dict[str, Any]) -> dict[str, Any]:
    """{dotted key: value} of what decides the finished shards' bytes, from a validated config (the extract rule's
    params for extract.*, the regenerate rule's for regenerate.* while the stage is on)."""
    from .settings import ExtractSettings, RegenerateSettings

    keys = {f"{sec}.{k}": config.get(sec, {}).get(k) for sec, names in CONTENT_KEYS.items() for k in names}
    keys |= {f"extract.{k}": v for k, v in ExtractSettings.params(config).items()}
    regen = config.get("regenerate", {})
    keys["regenerate.enabled"] = bool(regen.get("enabled"))
    if keys["regenerate.enabled"]:
        keys["regenerate.num_shards"] = regen.get("num_shards")
        keys |= {f"regenerate.{k}": v for k, v in RegenerateSettings.params(config).items()}
    return json.loads(json.dumps(keys, default=str))  # as the record reads it back (lists, not tuples)


def token_keys(keys: dict[str, Any]) -> dict[str, Any]:
    """The part of shard_keys that decides the tokenized shards (all but extract's and the layers)."""
    return {k: v for k, v in keys.items() if k.split(".")[0] in TOKEN_SECTIONS}


@dataclass(frozen=True, slots=True)
class PlanSource:
    """Which tokenized shards `snakemake plan` reads (eagle3prep.plan.stage): `tokenized`, made through Snakemake
    when `from_run` (a folder with no tokenized shards and no finished shard yet: the run's own first step), else
    read as they are; `prepared` is set when the plan makes `tokenized` itself, in a scratch folder."""

    tokenized: str
    from_run: bool = False
    prepared: str | None = None


def plan_source(keys: dict[str, Any], record_path: str | os.PathLike = RECORD, tokenized: str = TOKENIZED,
                shard_root: str | os.PathLike = HIDDEN_STATES, scratch: str = PLAN_SCRATCH) -> PlanSource:  # fmt: skip
    """results/tokenized when it holds this config's shards (the record's token keys are this config's), or when
    there is none and no finished shard; otherwise this config's in `scratch` (named by a hash of its token keys),
    so that a plan leaves results/ as it is."""
    if not os.path.exists(tokenized) and not finished_shards(shard_root):
        return PlanSource(tokenized, from_run=True)
    changed, old = changed_keys(token_keys(keys), record_path)
    if old and not changed and os.path.isfile(os.path.join(tokenized, "stats.json")):
        return PlanSource(tokenized)
    mine = token_keys(keys)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()[:12]
    prepared = f"{scratch}/prepared-{digest}"
    same_data = old and not [k for k in changed if k.split(".")[0] in ("data", "regenerate")]
    if same_data and not keys.get("regenerate.enabled") and os.path.isfile(f"{PREPARED}/counts.json"):
        prepared = PREPARED  # read as it is: only the tokenize keys differ
    return PlanSource(f"{scratch}/tokenized-{digest}", prepared=prepared)


def changed_keys(keys: dict[str, Any], record_path: str | os.PathLike = RECORD) -> tuple[list[str], dict[str, Any]]:
    """(the shard keys whose value differs from the record's, the record's keys); a key the record does not hold
    (one added after it was written) is not a change."""
    old = (read_record(record_path) or {}).get("shard_keys")
    if not isinstance(old, dict):
        return [], {}
    return [k for k in keys if k in old and old[k] != keys[k]], old


def redo_cost(shard_root: str | os.PathLike = HIDDEN_STATES, gpus_per_job: int = 1) -> str:
    """About what the finished shards took, by their own timings.json (engine start + capture, scaled to the
    shards without one): "about 3.2 GPU-hours by their timings.json", or that none has one."""
    n, timed, seconds = 0, 0, 0.0
    for folder in _finished_folders(shard_root):
        n += 1
        try:
            t = json.loads(Path(folder, "timings.json").read_text(encoding="utf-8"))
            seconds += float(t.get("engine_start_s") or 0) + float(t["capture_s"])
            timed += 1
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not timed:
        return "no timings.json says what they took"
    seconds *= n / timed
    unit = "GPU" if gpus_per_job else "CPU job"
    return f"about {human_duration(seconds * max(gpus_per_job, 1), unit)} by their timings.json"


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
    """The one line that says an accepted config change (REPLACE) extracts finished shards again, naming the keys
    and the count; None when no shard key changed or no shard of this config is finished."""
    changed, old = changed_keys(keys, record_path)
    if not changed:
        return None
    n = sum(os.path.isfile(os.path.join(shard_root, f"shard_{k}", MANIFEST)) for k in shards)
    if not n:
        return None
    return (
        f"{REPLACE}: config change {_what(changed, old, keys)} since the last run: {n} finished "
        f"shard{'s' * (n != 1)} will be extracted (and validated) again"
    )


def _what(changed: list[str], old: dict[str, Any], keys: dict[str, Any]) -> str:
    what = ", ".join(f"{k} {_short(old[k])} -> {_short(keys[k])}" for k in changed[:3])
    return what + (f" (and {len(changed) - 3} more keys)" if len(changed) > 3 else "")


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
    from .infra.atomic import atomic_open

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return True


def _finished_folders(shard_root: str | os.PathLike = HIDDEN_STATES) -> list[str]:
    """Shard folders with a manifest (one listing, one stat each)."""
    try:
        with os.scandir(shard_root) as entries:
            names = sorted(e.name for e in entries if e.name.startswith("shard_") and e.is_dir())
    except FileNotFoundError:
        return []
    return [os.path.join(shard_root, n) for n in names if os.path.isfile(os.path.join(shard_root, n, MANIFEST))]


def kept_logprob_rows(
    record_path: str | os.PathLike = RECORD, shard_root: str | os.PathLike = HIDDEN_STATES
) -> int | None:
    """What extract.logprob_rows: auto must not fall below (config.schema.logprob_rows): the count the record says
    the finished shards were made with, the old default (4) when no record says, None when no shard is finished."""
    if not finished_shards(shard_root):
        return None
    kept = ((read_record(record_path) or {}).get("shard_keys") or {}).get("extract.logprob_rows")
    return kept if isinstance(kept, int) and not isinstance(kept, bool) else SCALABLE_LOGPROB_ROWS


def finished_shards(hidden_states: str | os.PathLike = HIDDEN_STATES) -> int:
    """How many shard folders have a manifest."""
    return len(_finished_folders(hidden_states))


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
    keys: dict[str, Any] | None = None,
    gpus_per_job: int = 1,
) -> tuple[str | None, str | None]:
    """(error, note): the one line that refuses this run, or the note that it replaces another config's shards
    (config key REPLACE); (None, None) when the folder holds no finished shard this config would extract again.
    `config_files`: this run's, as shown; `demo`: none was given and the demo's config/config.yaml is read;
    `command`: the user's, for the commands the line suggests; `keys`: this config's shard_keys (None: only the
    identity is compared); `gpus_per_job`: what one extract job holds, for the cost."""
    old = read_record(record_path)
    if old is None:
        return None, None
    now = identity(settings)
    differ = [k for k in IDENTITY if old["identity"].get(k) != now[k]]
    changed, old_keys = changed_keys(keys, record_path) if keys is not None and not differ else ([], {})
    if not differ and not changed:
        return None, None
    n = finished_shards(hidden_states)
    if not n:
        return None, None
    theirs = _files(old.get("config_files") or [])
    shards = f"{n} finished shard{'s' if n != 1 else ''}"
    cost = redo_cost(hidden_states, gpus_per_job)
    if differ:
        what = "; ".join(f"{k} {_short(old['identity'].get(k))} there, {_short(now[k])} here" for k in differ)
        if settings.replace_results:
            return None, f"{REPLACE}: replacing the {shards} of {theirs} in results/ ({what})"
        head = (
            f"config error: results/ holds {shards} and was last run with {theirs}; this run's config "
            f"{_files(config_files, demo)} differs in {what}, so it would extract them again ({cost}). "
        )
    else:
        if settings.replace_results:
            return None, None  # redo_note says what is extracted again
        head = (
            f"config error: results/ holds {shards} made with another value of a key that decides their bytes: "
            f"{_what(changed, old_keys, keys)}; this run's config {_files(config_files, demo)} would extract all "
            f"{n} again ({cost}). Put the old value back to keep them; "
        )
    ways = _ways(old, config_files, demo, command or Command(), recorded_first=bool(differ))
    return head + "; ".join(w[0].upper() + w[1:] if i == 0 and differ else w for i, w in enumerate(ways)), None


def _ways(old: dict[str, Any], config_files: list[str], demo: bool, command: Command,
          recorded_first: bool) -> list[str]:  # fmt: skip
    """The ways out a refusal names: the config that made the shards, another folder, and accepting it."""
    ways = []
    recorded = old.get("config_files") or []
    if recorded_first and recorded and recorded != list(config_files):
        # The config that made the shards: the likeliest fix for a forgotten or wrong --configfile.
        theirs_command = command.setting("--configfile", *[f for f in recorded if f != "--config"])
        ways.append(f"run with the config that made them: {theirs_command}")
    ways.append(f"run this config in another folder: {command.setting('--directory', 'OTHER_FOLDER')}")
    if not demo:
        # Only the user's own config may replace the shards: the demo's, read for a forgotten --configfile,
        # would extract them again with the demo's model and sources.
        replace = command.adding("--config", f"{REPLACE}=true")
        ways.append(f"or replace them with this config: {replace} (or {REPLACE}: true in the config)")
    return ways
