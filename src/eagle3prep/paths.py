"""Every path the workflow writes, relative to the working directory: the rules (rules/*.smk) and the package read
them here, so a folder is named once. Outputs go under results/<step>/, logs under logs/<rule>/, benchmarks under
benchmarks/<rule>/, with the wildcards of the output they belong to. A function's `k` defaults to the rules'
wildcard `{k}`, so the same call gives a rule its pattern and the package one shard's path. Imports nothing: the
Snakefile reads it at parse time."""

from __future__ import annotations

PREPARED = "results/prepared"
# The regenerate stage's prompt shards, its shards, and the conversations it hands to tokenize.
REGENERATE = "results/regenerate"
REGEN_PROMPTS = f"{REGENERATE}/prompts"
REGENERATED = "results/regenerated"
# The tokenize job's one output folder: shard_{k}.jsonl, stats.json, token_freq.json, quarantine.jsonl.
TOKENIZED = "results/tokenized"
HIDDEN_STATES = "results/hidden_states"
VALIDATION = "results/validation"
FAILED = "results/failed"  # failed shards set aside by healing, shard_k[.n]/
SET_ASIDE_VERDICT = "validation.json"  # in a set-aside copy: the failed validation report
REPORT_DIR = "results/report"
REPORT = f"{REPORT_DIR}/report.html"
SUMMARY = f"{REPORT_DIR}/summary.csv"
DATASET_MANIFEST = f"{REPORT_DIR}/dataset_manifest.json"
EXPORT = "results/export/speculators"
OVERFIT_GATE = f"{VALIDATION}/overfit_gate.json"
OVERFIT_GATE_WORK = "results/overfit_gate"
# Which config made results/ (eagle3prep.made_by), and what the last `snakemake verify` found damaged.
CONFIG_RECORD = "results/config.json"
VERIFIED = "results/verify.json"
# The workflow's own upkeep, outside results/: the plan's scratch and output, and heal tickets.
PLAN_DIR = ".eagle3prep/plan"
HEAL_TICKETS = ".eagle3prep/heal"
MANIFEST = "manifest.json"  # a finished folder's last file (shard.MANIFEST; not imported, to keep torch out)
# What the workflow writes: never a config file.
OUTPUT_ROOTS = ("results", "logs", "benchmarks", ".eagle3prep")


def prepared(name: str, root: str = PREPARED) -> str:
    """conversations.jsonl, quarantine.jsonl or counts.json of prepare (or, root=REGENERATED, of regenerate)."""
    return f"{root}/{name}"


def tokenized_shard(k: int | str = "{k}") -> str:
    return f"{TOKENIZED}/shard_{k}.jsonl"


def regen_prompt_shard(k: int | str = "{k}") -> str:
    return f"{REGEN_PROMPTS}/shard_{k}.jsonl"


def regen_shard(k: int | str = "{k}") -> str:
    return f"{REGENERATE}/shard_{k}"


def shard_dir(k: int | str = "{k}") -> str:
    return f"{HIDDEN_STATES}/shard_{k}"


def shard_manifest(k: int | str = "{k}") -> str:
    return f"{shard_dir(k)}/{MANIFEST}"


def validation_json(k: int | str = "{k}") -> str:
    return f"{VALIDATION}/shard_{k}.json"


def failed_verdict(validation: str) -> str:
    """Where a validation report goes when its shard fails: the job's output must not look like a pass, and the
    verdict stays for the next run's healing and the report's banner."""
    return validation.removesuffix(".json") + ".failed.json"


def validation_failure(k: int | str = "{k}") -> str:
    return failed_verdict(validation_json(k))


def heal_ticket(n: int | str) -> str:
    return f"{HEAL_TICKETS}/{n}.json"


def log(name: str) -> str:
    """logs/<name>.log: `log("extract/shard_{k}")` is extract's, `log("prepare")` prepare's."""
    return f"logs/{name}.log"


def benchmark(name: str) -> str:
    return f"benchmarks/{name}.tsv"
