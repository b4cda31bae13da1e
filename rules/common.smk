import os
import sys
import time

from eagle3prep.config import ConfigError
from eagle3prep.run import closing, command, environment, heal, made_by, progress, stale
from eagle3prep.settings import ExtractSettings, RegenerateSettings, Settings
from eagle3prep.run.parse import (
    check_model,
    check_model_files,
    check_target_marker,
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
    check_target_marker(config, CONFIGFILES, os.getcwd())
    # The config as typed settings, built once; rules read SETTINGS, and pass `config` only where its
    # mapping is the params (Snakemake compares their repr, so the user's key order stays).
    SETTINGS = Settings.validated(config, workflow.source_path("../config/schema.yaml"))
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
# The tokenize job's output is this one folder, not one output per shard: Snakemake's DAG work
# grows with (outputs of a job) x (jobs using them), so N declared outputs made `-n` quadratic.
TOKENIZED = "results/tokenized"


wildcard_constraints:
    k=r"\d+",


if workflow.is_main_process and not workflow.dryrun:
    for _lock in clear_stale_locks():
        print(
            f"eagle3prep: removed stale lock {_lock} (its run was killed)",
            file=sys.stderr,
        )


# Shards that are missing, unfinished, changed after validation or failed it are redone by the same
# command, each named in one line (eagle3prep.run.heal; docs/guides/reruns.md). They are forced
# as with --forcerun. The command line's settings exist only after the Snakefile is parsed, so the check
# runs just before Snakemake makes its DAG (Workflow._prepare_dag), in the main process, for a run or dry
# run of the whole workflow.
# A Snakemake without that internal stops here in one line rather than turning healing off in silence.
HEALS = []
if workflow.is_main_process and (_hook_error := heal.snakemake_hook_error(workflow)):
    sys.exit(_hook_error)
if workflow.is_main_process:
    _prepare_dag = workflow._prepare_dag

    def _prepare_dag_healed(*args, **kwargs):
        settings = workflow.dag_settings
        # Another config's finished shards: refused before any job, in a run and in -n (eagle3prep.run.made_by).
        if set(settings.targets) != {"verify"}:
            _error, _note = made_by.check(
                SETTINGS, CONFIG_SHOWN, demo=not CONFIGFILES, command=_command
            )
            if _error:
                sys.exit(_error)
            if _note:
                print(f"eagle3prep: {_note}", file=sys.stderr)
            _keys = made_by.shard_keys(config)
            if _redo := made_by.redo_note(_keys, SHARDS):
                print(f"eagle3prep: {_redo}", file=sys.stderr)
            # Before the DAG, since onstart does not run when there is nothing to do; -n writes nothing.
            if not workflow.dryrun:
                made_by.write_record(SETTINGS, CONFIG_SHOWN, keys=_keys)
        if not workflow.touch and set(settings.targets) <= {"all"}:
            HEALS[:] = heal.find(SHARDS, SETTINGS.heal.keep_failed, workflow.dryrun)
            for line in heal.summary(HEALS):
                print(f"eagle3prep: {line}", file=sys.stderr)
            # The last report no longer tells the truth about these shards until a run rebuilds it.
            if not workflow.dryrun and (
                _stale := [h.why for h in HEALS if h.shard is not None]
            ):
                if stale.mark_stale(_stale):
                    print(
                        f"eagle3prep: marked {stale.REPORT} STALE until this run rebuilds it",
                        file=sys.stderr,
                    )
            forced = {h.force for h in HEALS if h.force}
            settings.forcerun = set(settings.forcerun) | forced
        _prepare_dag(*args, **kwargs)

    workflow._prepare_dag = _prepare_dag_healed

    # What the jobs that will run need of this Python (eagle3prep.run.environment): an engine or library it lacks,
    # or a CUDA device its torch does not see, is one line before any job (in -n too), where every such job would
    # die in its own traceback. Asked once the DAG is built (Workflow._build_dag), of a run or dry run only (not
    # --lint or --summary), for the rules of the jobs that will run. The GPU is asked only where the jobs run on
    # this host: a non-local executor (--executor slurm) runs them on GPU nodes, and its submit host may have none.
    _build_dag = workflow._build_dag

    def _build_dag_checked(*args, **kwargs):
        built = _build_dag(*args, **kwargs)
        if workflow.executor_plugin is not None and not workflow.touch:
            jobs = {job.rule.name for job in workflow.dag.needrun_jobs()}
            for error in (
                environment.check(
                    SETTINGS, conda=_conda, source_paths=SOURCES, jobs=jobs
                ),
                environment.cuda_error(
                    SETTINGS, local_exec=workflow.local_exec, conda=_conda, jobs=jobs
                ),
            ):
                if error:
                    sys.exit(error)
        return built

    workflow._build_dag = _build_dag_checked


onstart:
    record_owner()
    # Each running GPU job's rate, share done and ETA on the terminal (EAGLE3PREP_PROGRESS_S=0: off).
    progress.start(
        SHARDS, regenerate_shards=REGEN_SHARDS if REGEN.workflow.enabled else ()
    )
    # Under Snakemake's lock, before any job: a failed shard moves aside, so its extract starts afresh.
    for _heal in HEALS:
        if _heal.set_aside:
            print(
                f"eagle3prep: moved {heal.shard_dir(_heal.shard)} to {heal.set_aside(_heal)}",
                file=sys.stderr,
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
    return f"{TOKENIZED}/shard_{wildcards.k}.jsonl"


def get_tokenized_shards():
    return expand(f"{TOKENIZED}/shard_{{k}}.jsonl", k=SHARDS)


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
    return expand("results/hidden_states/shard_{k}", k=SHARDS)


def get_final_output():
    out = [
        "results/report/report.html",
        "results/report/summary.csv",
        "results/report/dataset_manifest.json",
    ]
    if SETTINGS.export.speculators:
        out.append("results/export/speculators")
    return out


# ---- regenerate (opt-in, regenerate.enabled; rules/regenerate.smk) -----------------------------------------
# Off, the rules get what they had before the stage existed: same inputs, params and script lines (a script
# rule's `script:` line is its recorded code), so the DAG and the outputs are unchanged and no finished job of
# an existing results/ folder is re-queued.
REGEN = SETTINGS.regenerate
REGEN_SHARDS = list(range(REGEN.workflow.num_shards))
REGEN_PROMPTS = "results/regenerate/prompts"
# The conversations tokenize reads (and the counts the report starts from).
CONVERSATIONS = "results/regenerated" if REGEN.workflow.enabled else "results/prepared"


def get_regen_prompt_shard(wildcards):
    return f"{REGEN_PROMPTS}/shard_{wildcards.k}.jsonl"


def get_regen_gpus(wildcards=None):
    """GPUs one regenerate job holds: its tensor-parallel size."""
    return REGEN.content.tp_size


def get_regen_data_params(wildcards=None):
    """regenerate.* that decides a shard's conversations (settings.RegenerateContent), with
    tokenize.chat_template_kwargs when set: a speed knob or a DAG key re-queues no shard.
    """
    return RegenerateSettings.params(config)
