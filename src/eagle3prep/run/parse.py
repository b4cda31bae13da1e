"""What the Snakefile checks at parse time beyond the schema (config/): which config is in force (a
--configfile, or the demo's config/config.yaml), a target Snakemake took for a config file, the sources, and the
model folder (its depth against the layer ids, its vision tower, its tokenizer, loaded as the tokenize job loads
it). Each failure is one ConfigError line. The checks that need a stage's knowledge live here, not in the config
layer, which imports no stage."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..config import ConfigError
from ..config.model import check_max_seq_len
from ..layers import default_layer_ids
from ..model_facts import ModelFacts
from ..paths import HIDDEN_STATES, OUTPUT_ROOTS
from ..settings import Settings
from ..shard.formats import storage_format
from ..vllm.families import check_capture_path

# What extract loads its weights from (transformers and vLLM read these; *.pt and *.pth are older checkpoints).
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")

DEMO_CONFIG = "config/config.yaml"
# The targets the guides name. Typed after --configfile, Snakemake reads one as a config file before the Snakefile
# runs, and stops on the missing file in its own traceback; only a file of that name that exists reaches us.
TARGETS = ("all", "plan", "verify", "overfit_gate", "regenerate_review")


def cli_configfiles(workflow: object) -> list[str]:
    """The config files of the command line (--configfile, absolute), [] when none was given. Read from
    `workflow.overwrite_configfiles`, the property Snakefiles ask before a `configfile:` line (the documented
    directive lays every --configfile over its file's values, so it is read only when this is empty); a release
    without it stops the parse here rather than laying the demo's config under yours."""
    try:
        return [str(p) for p in workflow.overwrite_configfiles or ()]  # type: ignore[attr-defined]
    except AttributeError:
        import snakemake

        raise ConfigError(
            f"error: this Snakemake ({getattr(snakemake, '__version__', '?')}) has no "
            "Workflow.overwrite_configfiles, which eagle3prep reads to tell a --configfile from the demo's "
            f"{DEMO_CONFIG} (Snakefile); use the pinned release in envs/base.txt"
        ) from None


def demo_config_error(cwd: str | os.PathLike) -> str | None:
    """Without --configfile the demo's config/config.yaml is read from the working directory: one line when it
    is not there (a run folder given with --directory holds none), else None."""
    if (Path(cwd) / DEMO_CONFIG).is_file():
        return None
    return (
        f"config error: no --configfile given and no {DEMO_CONFIG} in the working directory {cwd}; "
        "pass your config with --configfile my-run.yaml"
    )


def config_source_line(
    configfiles: list[str], overrides: bool, cwd: str | os.PathLike, dropped: list[str] | None = None
) -> str:
    """The one line that says which config is in force, and where results go. `dropped`: the files of an earlier
    --configfile flag, which Snakemake does not read (only the last flag counts)."""
    if configfiles:
        shown = " + ".join(shown_path(f, cwd) for f in configfiles)
        demo = (Path(cwd) / DEMO_CONFIG).resolve()
        if any(Path(f).resolve() == demo for f in configfiles):
            demo_note = f"the demo's {DEMO_CONFIG} is one of them"
        else:
            demo_note = f"the demo's {DEMO_CONFIG} is not read"
        later = ", later files win" if len(configfiles) > 1 else ""
        source = f"config {shown} over the schema's defaults (eagle3prep/config/schema.yaml; {demo_note}{later})"
    else:
        source = f"config {DEMO_CONFIG} (the demo's; pass --configfile for your own)"
    extra = " + --config" if overrides else ""
    line = f"{source}{extra}; results in {Path(cwd).resolve() / 'results'}"
    if dropped:
        line += (
            f"; not read: {' '.join(dropped)} (only the last --configfile flag counts: "
            "give every file after one --configfile)"
        )
    return line


def shown_path(path: str, cwd: str | os.PathLike) -> str:
    """`path` relative to the working directory when it lies under it, else absolute (normalized)."""
    path = os.path.normpath(path)
    rel = os.path.relpath(path, cwd)
    return path if rel.startswith("..") else rel


def check_targets_after_configfile(configfiles: list[str], cwd: str | os.PathLike) -> None:
    """One line for a target typed after --configfile that Snakemake could read as a config file: one of the
    workflow's outputs (`results/report/summary.csv`), or a file named like a target the guides name."""
    for f in configfiles[1:]:
        output = _is_output(f, cwd)
        if output or (Path(f).name in TARGETS and os.path.dirname(os.path.abspath(f)) == os.path.abspath(cwd)):
            target = shown_path(f, cwd)
            files = " ".join(shown_path(c, cwd) for c in configfiles if c != f)
            but = ", but it is one of the workflow's outputs" if output else ""
            raise ConfigError(
                f"config error: `{target}` after --configfile was read as a config file (--configfile takes "
                f"several){but}; put the target first: snakemake {target} --configfile {files}"
            )


def _is_output(path: str, cwd: str | os.PathLike) -> bool:
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(cwd))
    return rel.split(os.sep)[0] in OUTPUT_ROOTS


# The last tokenizer check that passed: importing transformers costs seconds (more on a busy login node), and
# every `snakemake -n` parses the Snakefile; the same folder, files and settings are not checked twice.
TOKENIZER_STAMP = ".snakemake/eagle3prep/tokenizer-check.json"
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")  # never read by the check: their stats change nothing


def _tokenizer_key(path: Path, settings: Settings) -> str:
    """What the tokenizer check depends on: the folder's non-weight files (name, size, mtime), the settings it
    reads, and the transformers and eagle3prep versions."""
    from importlib.metadata import PackageNotFoundError, version

    files = sorted(
        (e.name, e.stat().st_size, e.stat().st_mtime_ns)
        for e in os.scandir(path)
        if e.is_file() and not e.name.endswith(WEIGHTS)
    )
    try:
        transformers_version = version("transformers")
    except PackageNotFoundError:
        transformers_version = None
    tok = settings.tokenize
    read = [settings.model.trust_remote_code, tok.template_fallback, dict(tok.chat_template_kwargs)]
    code = Path(__file__).parents[1] / "tokenize" / "template.py"
    blob = [str(path.resolve()), files, read, transformers_version, code.stat().st_mtime_ns]
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def check_tokenizer(settings: Settings, stamp: str | os.PathLike | None = TOKENIZER_STAMP) -> None:
    """The tokenize job's start-up checks, at parse time: the model folder's tokenizer loads as the job loads it
    (a fast tokenizer, from local files), has a chat template, and a user/assistant probe gets a loss mask with
    tokenize.template_fallback and chat_template_kwargs. Skipped while model.build_demo has yet to build the
    folder, and when `stamp` records a pass on the same files and settings."""
    path = Path(settings.model.path)
    if not path.is_dir():
        return  # check_model has refused a missing folder unless build_demo will make it
    key = _tokenizer_key(path, settings)
    if stamp is not None:
        try:
            if Path(stamp).read_text(encoding="utf-8") == key:
                return
        except OSError:
            pass
    from ..tokenize.template import ChatEncoder, TokenizeError, load_tokenizer

    tok = settings.tokenize
    try:
        tokenizer = load_tokenizer(path, settings.model.trust_remote_code)
        ChatEncoder(tokenizer, path, tok.template_fallback, tok.chat_template_kwargs)
    except TokenizeError as e:
        raise ConfigError(f"config error: model.path = {e}") from None
    except Exception as e:  # transformers' own (OSError, ValueError, ...), as the tokenize job would print them
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise ConfigError(
            f"config error: model.path = '{path}' has no tokenizer that loads ({why}); copy the model's tokenizer "
            "files (tokenizer.json, tokenizer_config.json) into the folder"
        ) from None
    if stamp is not None:
        from ..infra.atomic import atomic_open

        Path(stamp).parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(stamp, "w", encoding="utf-8") as f:
            f.write(key)


def check_model_files(settings: Settings) -> None:
    """What extract needs of the model folder beyond its depth: a hidden size (the shard's width) and weight files.
    Both stopped the extract job before (after prepare and tokenize had run); skipped while model.build_demo
    has yet to build the folder."""
    path = Path(settings.model.path)
    if not path.is_dir():
        return  # check_model has refused a missing folder unless build_demo will make it
    hidden_size = ModelFacts.read(path).hidden_size
    if hidden_size is None:
        raise ConfigError(
            f"config error: model.path = '{path}': config.json has no hidden_size (nor text_config.hidden_size); "
            "point model.path at a causal language model's folder"
        )
    try:  # a block-scaled storage needs whole blocks in a row
        storage_format(settings.extract.content.storage).check_width(hidden_size)
    except ValueError as e:
        raise ConfigError(
            f"config error: extract.storage = {settings.extract.content.storage}: {e} ({path / 'config.json'}); "
            "choose fp8_e4m3 or model_dtype"
        ) from None
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_GLOBS):
        raise ConfigError(
            f"config error: model.path = '{path}' holds no weight files ({', '.join(WEIGHT_GLOBS)}); "
            "copy the model's weights into that folder"
        )


def check_model(settings: Settings) -> list[str]:
    """What the model folder decides, checked when the workflow is parsed, before any job: the folder and its
    config.json exist, the layer ids fit its depth, max_seq_len its context. Returns notes for the user (one
    line each). Skipped while the folder does not exist yet and model.build_demo will build it."""
    path = Path(settings.model.path)
    if not path.is_dir():
        if settings.model.build_demo:  # the demo's depth is known before its rule builds it
            return demo_drafts_notes(settings)
        raise ConfigError(
            f"config error: model.path = '{path}': no such folder (cwd: {os.getcwd()}); set model.path to a local "
            "Hugging Face model folder (or model.build_demo: true to build the demo model there)"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"config error: model.path = '{path}' has no config.json; point model.path at the model folder itself "
            "(config.json, safetensors weights, tokenizer)"
        )
    try:
        n = ModelFacts.read(path).num_hidden_layers
    except (ValueError, OSError) as e:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"config error: model.path = '{path}': cannot read config.json ({e})") from None
    notes = []
    if settings.layers.ids is None and not settings.layers.drafts:
        ids, formula = default_layer_ids(n), [2, n // 2, n - 3, n]
        if len(ids) < len(formula):
            notes.append(
                f"layers.ids: the default [2, N//2, N-3, N] is {formula} for this N = {n} ({path / 'config.json'}); "
                f"{len(ids)} distinct ids {ids} are captured, not 4; set layers.ids to choose others"
            )
    else:
        ids = settings.layer_ids()  # raises ConfigError in one line (the drafts' layers included)
        if settings.layers.drafts:
            notes += drafts_notes(settings, n, ids)
        if settings.export.speculators:
            from ..shard.shardset import speculators_layer_error

            if error := speculators_layer_error(ids, n, settings.layers.convention):
                raise ConfigError(f"config error: {error}")
    check_max_seq_len(settings.tokenize.max_seq_len, path, settings.extract.content.backend)
    check_capture_path(settings.extract.content.backend, settings.extract.content.capture_path, path)
    if note := images_note(settings, path):
        notes.append(note)
    return notes


def demo_drafts_notes(settings: Settings) -> list[str]:
    """The drafts' lines of a run whose demo model is still to be built (model.build_demo)."""
    if not settings.layers.drafts:
        return []
    from ..demo import NUM_HIDDEN_LAYERS

    try:
        ids = settings.layers.capture_ids(NUM_HIDDEN_LAYERS)
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None
    return drafts_notes(settings, NUM_HIDDEN_LAYERS, ids)


def finished_layer_ids(hidden_states: str | os.PathLike = HIDDEN_STATES) -> list[int] | None:
    """The layer ids every finished shard holds (their manifests' `layer_ids` in common); None without one."""
    held = None
    for manifest in sorted(Path(hidden_states).glob("shard_*/manifest.json")):
        try:
            ids = json.loads(manifest.read_text(encoding="utf-8"))["layer_ids"]
        except (OSError, ValueError, KeyError):  # an unfinished or broken shard: healing redoes it
            continue
        held = set(ids) if held is None else held & set(ids)
    return None if held is None else sorted(held)


def drafts_notes(settings: Settings, n: int, ids: list[int], hidden_states: str | os.PathLike = HIDDEN_STATES
                 ) -> list[str]:  # fmt: skip
    """Each draft's layers and the union the run captures (the opening lines of -n and a run); a ConfigError in one
    line when finished shards lack a draft's layers and the config does not let the run replace them."""
    from ..drafts import draft_lines, missing_layers, resolve_drafts

    try:
        drafts = resolve_drafts(settings.layers.drafts, n)
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None
    held = finished_layer_ids(hidden_states)
    missing = missing_layers(drafts, held) if held is not None else {}
    if missing and not settings.replace_results:
        name, lack = next(iter(missing.items()))
        raise ConfigError(
            f"config error: layers.drafts: draft {name} reads layer ids {lack} that the finished shards in "
            f"{hidden_states} do not hold (they hold {held}); capturing them extracts every shard again: set "
            "replace_results: true to do so, or drop the draft"
        )
    return [f"layers.drafts: {line}" for line in draft_lines(drafts, ids)]


def images_note(settings: Settings, path: Path) -> str | None:
    """A target whose images tokenize cannot expand (no vision tower, or one not implemented, e.g. Kimi-K2.5's
    MoonViT): a ConfigError when data.image_root says the run means images, else a note when the target has a
    vision tower (its image conversations would be quarantined). None otherwise."""
    image_root = settings.data.image_root
    model_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if image_root is None and "vision_config" not in model_config:
        return None
    from ..tokenize.vision import UNSUPPORTED, images_refusal

    refusal = images_refusal(model_config)
    if refusal is None:
        return None
    if image_root is not None:
        raise ConfigError(
            f"config error: data.image_root = '{image_root}' is set, but {refusal} ({path / 'config.json'})"
        )
    return (
        f"model.path: {refusal}: conversations with images will be quarantined ({UNSUPPORTED}); text conversations "
        "are unaffected"
    )


def config_sources(settings: Settings) -> list[str]:
    """data.sources expanded (globs, repeats dropped), or a one-line ConfigError naming the source."""
    from ..prepare import InputError, expand_sources

    try:
        return expand_sources(list(settings.data.sources))
    except InputError as e:
        raise ConfigError(f"config error: {e}") from None
