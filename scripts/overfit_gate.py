# vLLM may start its workers with spawn, which re-imports this file as __mp_main__, where Snakemake's
# `snakemake` object does not exist: everything, the log redirect included, stays under the guard.
if __name__ == "__main__":
    import os
    import sys

    sys.stderr = open(snakemake.log[0], "w", buffering=1)
    os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM engine, the trainer) log there too
    os.dup2(sys.stderr.fileno(), 1)  # and vLLM's logger writes to stdout: its lines belong to this job

    from eagle3prep.errors import one_line_errors
    from eagle3prep.overfit_gate.stage import run_overfit_gate_job
    from eagle3prep.settings import ExtractSettings, LayersSettings, RegenerateSettings, TokenizeSettings

    with one_line_errors():
        run_overfit_gate_job(
            snakemake.params.tokens,
            snakemake.output[0],
            snakemake.params.work,
            model_path=snakemake.input.model,
            layers=LayersSettings.of(snakemake.params.layers),
            extract=ExtractSettings.from_config(snakemake.config),
            regenerate=RegenerateSettings.from_config(snakemake.config),
            chat_template_kwargs=TokenizeSettings.from_config(snakemake.config).chat_template_kwargs,
            trust_remote_code=snakemake.params.trust_remote_code,
            threads=snakemake.threads,
        )
