import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (open for the whole job)
os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM workers, tokenizers) log there too

from eagle3prep.errors import one_line_errors
from eagle3prep.settings import TokenizeSettings
from eagle3prep.tokenize import run_tokenize_job

with one_line_errors():
    run_tokenize_job(
        snakemake.input.conversations,
        snakemake.input.counts,
        snakemake.input.quarantine,
        snakemake.output[0],
        list(snakemake.params.shards),
        model_path=snakemake.input.model,
        # the config as validated: the rule's params (its rerun trigger) hold the same values
        settings=TokenizeSettings.from_config(snakemake.config),
        trust_remote_code=snakemake.params.trust_remote_code,
        workers=snakemake.threads,
    )
