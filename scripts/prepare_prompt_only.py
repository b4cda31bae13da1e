# prepare with regenerate.enabled: records without an assistant turn are kept (the target writes the replies).
import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (the log stays open for the job)
os.dup2(sys.stderr.fileno(), 2)

from eagle3prep.errors import one_line_errors
from eagle3prep.prepare import PrepareJobSettings, PreparePaths, run_prepare_job

with one_line_errors():
    out = snakemake.output
    paths = PreparePaths(out.conversations, out.quarantine, out.counts, log_path=snakemake.log[0])
    prompt_only = bool(snakemake.params.allow_prompt_only)
    run_prepare_job(paths, PrepareJobSettings.from_config(snakemake.config, allow_prompt_only=prompt_only))
