# The GPU rule: one job per shard; the shard folder counts as finished only with its manifest.
# Both `gpus` and Snakemake's standard `gpu` are declared, so `--resources gpus=8` and
# `--resources gpu=8` both cap how many GPUs the running jobs hold together.
rule extract:
    input:
        tokenized=TOKENIZED,
        model=get_model(),
        ticket=heal_ticket("extract/{k}"),
        environment=GUARD.input("extract", shard_extract_runs),
    output:
        directory(paths.shard_dir()),
    log:
        paths.log("extract/shard_{k}"),
    benchmark:
        paths.benchmark("extract/shard_{k}")
    conda:
        get_extract_env()
    threads: SETTINGS.extract.speed.threads
    resources:
        gpus=get_gpus(),
        gpu=get_gpus(),
    params:
        tokens=get_tokenized_shard,
        extract=get_extract_data_params(),
        layers=LayersSettings.params(config),
        max_seq_len=SETTINGS.tokenize.max_seq_len,
        trust_remote_code=SETTINGS.model.trust_remote_code,
    script:
        "../scripts/extract.py"
