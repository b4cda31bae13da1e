import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM workers, tokenizers) log there too

from eagle3prep.errors import one_line_errors
from eagle3prep.infra.log import get_logger
from eagle3prep.plan.stage import run_plan_job
from eagle3prep.settings import Settings

with one_line_errors():
    text = run_plan_job(
        snakemake.input.get("tokenized") or snakemake.params.tokenized,
        snakemake.params.hidden_states,
        snakemake.output.json,
        snakemake.output.txt,
        model_path=snakemake.input.model,
        # the whole config as validated: the rule's params (its rerun trigger) hold the same values
        settings=Settings.from_config(snakemake.config),
        gpus_per_job=snakemake.params.gpus,
        # set when the plan tokenizes another config's conversations itself, in .eagle3prep/plan/
        prepared=snakemake.params.prepared,
    )
    get_logger("plan").info(text)
    print(text, file=sys.__stdout__)  # `snakemake plan` shows the plan on the terminal
