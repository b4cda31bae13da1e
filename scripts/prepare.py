import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (the log stays open for the job)
os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM workers, tokenizers) log there too

from eagle3prep.errors import one_line_errors
from eagle3prep.prepare import PrepareJobSettings, PreparePaths, run_prepare_job

with one_line_errors():
    out = snakemake.output
    paths = PreparePaths(out.conversations, out.quarantine, out.counts, log_path=snakemake.log[0])
    # the config as validated: the rule's params (its rerun trigger) hold the same values, and
    # data.max_quarantine_share is read from it alone (it decides no byte, so changing it re-queues no job)
    run_prepare_job(paths, PrepareJobSettings.from_config(snakemake.config, allow_prompt_only=False))
