import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM workers, tokenizers) log there too

from eagle3prep.errors import one_line_errors
from eagle3prep.infra.log import get_logger
from eagle3prep.plan.stage import PlanJobSettings, PlanPaths, run_plan_job

with one_line_errors():
    paths = PlanPaths(
        snakemake.input.get("tokenized") or snakemake.params.tokenized,
        snakemake.params.hidden_states,
        snakemake.output.json,
        snakemake.output.txt,
        snakemake.input.model,
        # set when the plan tokenizes another config's conversations itself, in .eagle3prep/plan/
        prepared=snakemake.params.prepared,
    )
    # the whole config as validated: the rule's params (its rerun trigger) hold the same values
    text = run_plan_job(paths, PlanJobSettings.from_config(snakemake.config, gpus_per_job=snakemake.params.gpus))
    get_logger("plan").info(text)
    print(text, file=sys.__stdout__)  # `snakemake plan` shows the plan on the terminal
