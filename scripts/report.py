import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM workers, tokenizers) log there too

from eagle3prep.errors import one_line_errors
from eagle3prep.report import ReportJobSettings, ReportPaths, run_report_job
from eagle3prep.report.stale import FAILED

with one_line_errors():
    paths = ReportPaths(
        validations=list(snakemake.input.validations),
        shard_dirs=list(snakemake.input.shards),
        tokenized=list(snakemake.params.tokens),
        counts_path=snakemake.input.counts,
        stats_path=snakemake.params.stats,
        token_freq_path=snakemake.params.token_freq,
        benchmarks=list(snakemake.params.benchmarks),
        out_html=snakemake.output.html,
        out_csv=snakemake.output.summary,
        out_manifest=snakemake.output.manifest,
        export_dir=snakemake.input.export[0] if snakemake.input.export else None,
        # Only rule report_with_gate (rules/overfit_gate.smk) has this input.
        overfit_gate=snakemake.input.get("gate"),
        model_dir=snakemake.input.model,
        # Not an input: a set-aside copy is listed, but moving one out of the way re-queues nothing.
        failed_dir=FAILED,
    )
    run_report_job(paths, ReportJobSettings.from_config(snakemake.config))
