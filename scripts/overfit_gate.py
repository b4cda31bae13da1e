# vLLM may start its workers with spawn, which re-imports this file as __mp_main__, where Snakemake's
# `snakemake` object does not exist: everything, the log redirect included, stays under the guard.
if __name__ == "__main__":
    import os
    import sys

    sys.stderr = open(snakemake.log[0], "w", buffering=1)
    os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM engine, the trainer) log there too
    os.dup2(sys.stderr.fileno(), 1)  # and vLLM's logger writes to stdout: its lines belong to this job

    from eagle3prep.errors import one_line_errors
    from eagle3prep.overfit_gate.stage import OverfitGateJobSettings, OverfitGatePaths, run_overfit_gate_job

    with one_line_errors():
        paths = OverfitGatePaths(
            snakemake.params.tokens, snakemake.output[0], snakemake.params.work, snakemake.input.model
        )
        run_overfit_gate_job(paths, OverfitGateJobSettings.from_config(snakemake.config, threads=snakemake.threads))
