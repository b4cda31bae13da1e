import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (open for the whole job)
os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM workers, tokenizers) log there too

from eagle3prep.errors import one_line_errors
from eagle3prep.tokenize import TokenizeJobSettings, TokenizePaths, run_tokenize_job

with one_line_errors():
    i = snakemake.input
    paths = TokenizePaths(
        i.conversations, i.counts, i.quarantine, snakemake.output[0], list(snakemake.params.shards), i.model
    )
    # the config as validated: the rule's params (its rerun trigger) hold the same values
    run_tokenize_job(paths, TokenizeJobSettings.from_config(snakemake.config, workers=snakemake.threads))
