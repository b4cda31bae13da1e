import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM workers, tokenizers) log there too

from eagle3prep.errors import one_line_errors
from eagle3prep.infra.log import get_logger
from eagle3prep.run.plan import plan_run
from eagle3prep.settings import LayersSettings, PlanSettings

with one_line_errors():
    text = plan_run(
        snakemake.params.stats,
        snakemake.params.hidden_states,
        snakemake.output.json,
        snakemake.output.txt,
        model_path=snakemake.input.model,
        layers=LayersSettings.of(snakemake.params.layers),
        dtype=snakemake.params.dtype,
        storage=snakemake.params.storage,
        plan=PlanSettings.of(snakemake.params.plan),
        reference=snakemake.params.reference,
        windows=snakemake.params.windows,
        gpus_per_job=snakemake.params.gpus,
        export_copy=snakemake.params.export_copy,
        validate_device=snakemake.params.validate_device,
        sample_rows=snakemake.params.sample_rows,
    )
    get_logger("plan").info(text)
    print(text, file=sys.__stdout__)  # `snakemake plan` shows the plan on the terminal
