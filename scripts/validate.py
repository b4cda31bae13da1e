import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM workers, tokenizers) log there too

from eagle3prep.errors import one_line_errors
from eagle3prep.validate import ValidateJobSettings, ValidatePaths, run_validate_job

with one_line_errors(oom_fix="set validate.device: cpu, or lower validate.sample_rows"):
    paths = ValidatePaths(snakemake.input.shard, snakemake.params.tokens, snakemake.output[0], snakemake.input.model)
    # the config as validated, equal to params.validate (the rerun trigger) in the same run
    run_validate_job(paths, ValidateJobSettings.from_config(snakemake.config))
