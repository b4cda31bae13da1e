# prepare with regenerate.enabled: records without an assistant turn are kept (the target writes the replies).
import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (the log stays open for the job)
os.dup2(sys.stderr.fileno(), 2)

from eagle3prep.errors import one_line_errors
from eagle3prep.prepare import run_prepare_job
from eagle3prep.settings import DataSettings

with one_line_errors():
    run_prepare_job(
        snakemake.output.conversations,
        snakemake.output.quarantine,
        snakemake.output.counts,
        settings=DataSettings.from_config(snakemake.config),
        log_path=snakemake.log[0],
        allow_prompt_only=bool(snakemake.params.allow_prompt_only),
    )
