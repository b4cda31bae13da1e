import os
import sys
import time

from eagle3prep import made_by, paths
from eagle3prep.config import ConfigError
from eagle3prep.healing import tickets
from eagle3prep.report import stale
from eagle3prep.run import closing, command, environment, progress
from eagle3prep.infra.mode import Mode
from eagle3prep.settings import (
    ExtractSettings,
    LayersSettings,
    RegenerateSettings,
    Settings,
)
from eagle3prep.run.parse import (
    check_model,
    check_model_files,
    check_targets_after_configfile,
    check_tokenizer,
    config_source_line,
    config_sources,
    shown_path,
)
from eagle3prep.infra.runlock import clear_stale_locks, record_owner

# Nothing reaches the network at run time: models, tokenizers and datasets come from local folders.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# envs/*.post-deploy.sh install this checkout's package into a rule's conda env (--sdm conda).
os.environ.update(EAGLE3PREP_ROOT=str(workflow.basedir))

_overrides = bool(getattr(workflow.config_settings, "config", None))
# The config files as the user sees them, and a --config that may set keys over them (results/config.json).
CONFIG_SHOWN = [shown_path(f, os.getcwd()) for f in CONFIGFILES] or [
    "config/config.yaml"
]
CONFIG_SHOWN += ["--config"] if _overrides else []
if workflow.is_main_process:
    # The user's --configfile/--directory, for every command a job or a check suggests (eagle3prep.run.command).
    _command = command.from_argv(sys.argv)
    command.export(_command)
    _line = config_source_line(
        CONFIGFILES, _overrides, os.getcwd(), _command.dropped_configfiles
    )
    print(f"eagle3prep: {_line}", file=sys.stderr)
try:
    check_targets_after_configfile(CONFIGFILES, os.getcwd())
    # The config as typed settings, built once; rules read SETTINGS, and pass `config` only where its
    # mapping is the params (Snakemake compares their repr, so the user's key order stays).
    # against the package's schema.yaml; extract.logprob_rows: auto never below the finished shards'
    SETTINGS = Settings.validated(config, made_by.kept_logprob_rows())
    SOURCES = config_sources(SETTINGS)
    # Whatever the model folder decides (layer ids, max_seq_len, the tokenizer) fails here, before any job.
    MODEL_NOTES = check_model(SETTINGS)
    check_model_files(SETTINGS)
    # --sdm conda: each rule brings its own environment (the checks of the jobs' needs below ask nothing then).
    _deploy = getattr(
        getattr(workflow, "deployment_settings", None), "deployment_method", ()
    )
    _conda = "CONDA" in {str(m).upper().split(".")[-1] for m in _deploy}
    if workflow.is_main_process:  # loads the tokenizer: once, not in every spawned job
        check_tokenizer(SETTINGS)
except ConfigError as e:
    sys.exit(str(e))
if workflow.is_main_process:
    for _note in MODEL_NOTES:
        print(f"eagle3prep: note: {_note}", file=sys.stderr)

SHARDS = list(range(SETTINGS.tokenize.num_shards))
MODEL = SETTINGS.model.path
# What decides the finished shards' bytes: the results check below and the plan (plan.smk) read this one value.
SHARD_KEYS = made_by.shard_keys(config)
# The tokenize job's output is this one folder, not one output per shard: Snakemake's DAG work
# grows with (outputs of a job) x (jobs using them), so N declared outputs made `-n` quadratic.
TOKENIZED = paths.TOKENIZED


wildcard_constraints:
    k=r"\d+",


if workflow.is_main_process:
    for _lock in clear_stale_locks():
        print(
            f"eagle3prep: removed stale lock {_lock} (its run was killed)",
            file=sys.stderr,
        )


def _results_checks(mode):
    """Once, as Snakemake starts building the DAG of a target that holds shard jobs: a config that would extract
    finished shards again is refused (in a run and in -n) unless replace_results accepts it; a run records the
    config in results/config.json when it starts (onstart), never in -n, plan, verify or a refused run.
    """
    _error, _note = made_by.check(
        SETTINGS,
        CONFIG_SHOWN,
        demo=not CONFIGFILES,
        command=_command,
        keys=SHARD_KEYS,
        gpus_per_job=get_gpus(),
    )
    if _error:
        sys.exit(_error)
    if _note:
        print(f"eagle3prep: {_note}", file=sys.stderr)
    if _redo := made_by.redo_note(SHARD_KEYS, SHARDS):
        REDO.append(_redo)
        print(f"eagle3prep: {_redo}", file=sys.stderr)
    if mode.jobs_run:
        RECORD.append(SHARD_KEYS)


# Shards that are missing, unfinished, changed after validation or failed it are redone by the same command, each
# named in one line (eagle3prep.healing.heal; docs/guides/reruns.md), through heal tickets: a job to redo gets this
# run's ticket as one more input, a file newer than its outputs (eagle3prep.healing.tickets says how).
REDO = []  # the config change that redoes finished shards, when there is one
# This config's shard keys, for results/config.json when a run with shard jobs starts.
RECORD = []


def MODE():
    """A run, a dry run or neither, read when Snakemake builds the DAG (it is not known while the Snakefile is read)."""
    return Mode.of(workflow)


HEALING = tickets.Healing(
    SHARDS,
    SETTINGS.heal.keep_failed,
    main=workflow.is_main_process,
    mode=MODE,
    say=lambda line: print(f"eagle3prep: {line}", file=sys.stderr),
    before=_results_checks,
    mark_stale=stale.mark_for_heal,
)
# The one place healing writes before the DAG is built: a job's ticket must exist, newer than its outputs, when
# Snakemake compares them, and Snakemake calls no hook between this parse and that comparison (an input function
# would; they only look up what this found). Removed at exit unless onstart carries it out.
HEALING.prepare()


def heal_ticket(job):
    """The input function that asks healing for `job`'s ticket (`job` holds {k} for a shard's job)."""
    return lambda wildcards: HEALING.ticket(job.format(**wildcards))


# What the jobs that will run need of this Python (eagle3prep.run.environment): an engine or library it lacks, or a
# CUDA device its torch does not see, is one line before any job (in -n too), where every such job would die in its
# own traceback. Asked from an input function of each such rule, for its first job that will run.
GUARD = environment.Guard(
    SETTINGS,
    mode=MODE,
    main=workflow.is_main_process,
    sdm_conda=_conda,
    source_paths=SOURCES,
)


def shard_extract_runs(wildcards):
    """Whether extract will (re)make shard {k}: unfinished, healed, or a config change redoes the shards."""
    k = wildcards.k
    return (
        not os.path.exists(paths.shard_manifest(k))
        or HEALING.is_due(f"extract/{k}")
        or bool(REDO)
    )


def validation_runs(wildcards):
    """Whether validate will (re)judge shard {k} (its device may be a GPU): no verdict yet, healed, or re-extracted."""
    return (
        not os.path.exists(paths.validation_json(wildcards.k))
        or HEALING.is_due(f"validate/{wildcards.k}")
        or shard_extract_runs(wildcards)
    )


def export_runs(wildcards):
    return not os.path.exists(paths.EXPORT) or HEALING.is_due("export")


def missing(*patterns):
    """A will-run test for the environment guard: an output of the job is not there."""
    return lambda wildcards: any(
        not os.path.exists(p.format(**wildcards)) for p in patterns
    )


onstart:
    record_owner()
    for _keys in RECORD:
        made_by.write_record(SETTINGS, CONFIG_SHOWN, keys=_keys)
    # Healing's changes on disk (failed shards set aside, the last report marked stale), for the jobs to redo that
    # this run's DAG holds: under Snakemake's lock, before any job starts.
    HEALING.carry_out()
    # Each running GPU job's rate, share done and ETA on the terminal (EAGLE3PREP_PROGRESS_S=0: off).
    progress.start(
        SHARDS, regenerate_shards=REGEN_SHARDS if REGEN.workflow.enabled else ()
    )


RUN_STARTED_NS = time.time_ns()


onsuccess:
    for _line in closing.run_losses():
        print(f"eagle3prep: {_line}", file=sys.stderr)


onerror:
    for _line in closing.run_losses():
        print(f"eagle3prep: {_line}", file=sys.stderr)
    if closing.mark_report_after_failure(SHARDS, RUN_STARTED_NS):
        print(
            f"eagle3prep: marked {stale.REPORT} STALE: it was not rebuilt and does not describe this run's shards",
            file=sys.stderr,
        )


def get_model(wildcards=None):
    """The model folder; built by build_demo_model when model.build_demo is set."""
    return MODEL


def get_template_kwargs_params(wildcards=None):
    """tokenize.chat_template_kwargs as params, none at its default {} (TokenizeSettings.template_kwargs_params)."""
    return SETTINGS.tokenize.template_kwargs_params()


def get_tokenized_shard(wildcards):
    """The tokenized rows of shard {k} (a file inside the tokenize job's folder)."""
    return paths.tokenized_shard(wildcards.k)


def get_tokenized_shards():
    return expand(paths.tokenized_shard(), k=SHARDS)


def get_extract_env():
    """The extract rule's conda env: the GPU one (vLLM) for the vllm backend."""
    return (
        "../envs/gpu.yaml"
        if SETTINGS.extract.content.backend == "vllm"
        else "../envs/cpu.yaml"
    )


def get_gpus(wildcards=None):
    """GPUs one extract job holds: tp_size for vLLM, 1 for hf on cuda, 0 on CPU."""
    ex = SETTINGS.extract.content
    if ex.backend == "vllm":
        return ex.tp_size
    return 1 if ex.device == "cuda" else 0


def get_validate_gpus(wildcards=None):
    """GPUs one validate job holds: 1 when its reference runs on cuda."""
    v = SETTINGS.validate
    return 1 if v.reference_mode == "full" and v.device.startswith("cuda") else 0


def get_extract_data_params(wildcards=None):
    """extract.* that decides a shard's bytes (settings.ExtractContent): changing a speed knob re-queues no shard."""
    return ExtractSettings.params(config)


def get_shard_dirs(wildcards=None):
    return expand(paths.shard_dir(), k=SHARDS)


def get_final_output():
    out = [paths.REPORT, paths.SUMMARY, paths.DATASET_MANIFEST]
    if SETTINGS.export.speculators:
        out.append(paths.EXPORT)
    return out


# ---- regenerate (opt-in, regenerate.enabled; rules/regenerate.smk) -----------------------------------------
# Off, the rules get what they had before the stage existed: same inputs, params and script lines (a script
# rule's `script:` line is its recorded code), so the DAG and the outputs are unchanged and no finished job of
# an existing results/ folder is re-queued.
REGEN = SETTINGS.regenerate
REGEN_SHARDS = list(range(REGEN.workflow.num_shards))
REGEN_PROMPTS = paths.REGEN_PROMPTS
# The conversations tokenize reads (and the counts the report starts from).
CONVERSATIONS = paths.REGENERATED if REGEN.workflow.enabled else paths.PREPARED


def get_regen_prompt_shard(wildcards):
    return paths.regen_prompt_shard(wildcards.k)


def get_regen_gpus(wildcards=None):
    """GPUs one regenerate job holds: its tensor-parallel size."""
    return REGEN.content.tp_size


def get_regen_data_params(wildcards=None):
    """regenerate.* that decides a shard's conversations (settings.RegenerateContent), with
    tokenize.chat_template_kwargs when set: a speed knob or a DAG key re-queues no shard.
    """
    return RegenerateSettings.params(config)
