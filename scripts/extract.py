# vLLM may start its workers with spawn (when CUDA is initialized here), which re-imports this file
# as __mp_main__, where Snakemake's `snakemake` object does not exist: everything, the log redirect
# included, stays under the guard.
if __name__ == "__main__":
    import os
    import sys

    sys.stderr = open(snakemake.log[0], "w", buffering=1)
    os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM engine, workers) log there too
    os.dup2(sys.stderr.fileno(), 1)  # and vLLM's logger writes to stdout: its lines belong to this job

    from eagle3prep.errors import one_line_errors
    from eagle3prep.extract import run_extract_job
    from eagle3prep.settings import ExtractSettings, LayersSettings

    with one_line_errors():
        run_extract_job(
            snakemake.params.tokens,
            snakemake.output[0],
            model_path=snakemake.input.model,
            # from the config as it is now: params.extract is only the rerun trigger (settings.py says why)
            settings=ExtractSettings.from_config(snakemake.config),
            layers=LayersSettings.of(snakemake.params.layers),
            max_seq_len=snakemake.params.max_seq_len,
            trust_remote_code=snakemake.params.trust_remote_code,
            shard=int(snakemake.wildcards.k),
            threads=snakemake.threads,
        )
