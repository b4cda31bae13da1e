# vLLM may start its workers with spawn, which re-imports this file as __mp_main__, where Snakemake's
# `snakemake` object does not exist: everything, the log redirect included, stays under the guard.
if __name__ == "__main__":
    import os
    import sys

    sys.stderr = open(snakemake.log[0], "w", buffering=1)
    os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM engine, workers) log there too
    os.dup2(sys.stderr.fileno(), 1)  # and vLLM's logger writes to stdout: its lines belong to this job

    from eagle3prep.errors import one_line_errors
    from eagle3prep.regenerate import run_regenerate_job
    from eagle3prep.settings import RegenerateSettings, TokenizeSettings

    with one_line_errors():
        # Settings from the config as it is now (the params only trigger reruns, RegenerateSettings.params),
        # so a speed knob changed after a crash applies to the shards still to make.
        run_regenerate_job(
            snakemake.params.prompts,
            snakemake.output[0],
            model_path=snakemake.input.model,
            settings=RegenerateSettings.from_config(snakemake.config),
            chat_template_kwargs=TokenizeSettings.from_config(snakemake.config).chat_template_kwargs,
            trust_remote_code=snakemake.params.trust_remote_code,
            shard=int(snakemake.wildcards.k),
            max_seq_len=snakemake.params.max_seq_len,
            threads=snakemake.threads,
        )
