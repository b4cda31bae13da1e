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
    from eagle3prep.extract import ExtractJobSettings, ExtractPaths, run_extract_job

    with one_line_errors():
        paths = ExtractPaths(
            snakemake.params.tokens, snakemake.output[0], snakemake.input.model, shard=int(snakemake.wildcards.k)
        )
        # from the config as it is now: params.extract and params.layers are only the rerun trigger
        run_extract_job(paths, ExtractJobSettings.from_config(snakemake.config, threads=snakemake.threads))
