# Disk and GPU time before any GPU job runs: bytes per shard, free space, job time, a shard size.
# Not part of `all`: `snakemake plan` (add -f to refresh the free space after freeing disk).
rule plan:
    input:
        tokenized=TOKENIZED,
        model=get_model(),
    output:
        json="results/plan/plan.json",
        txt="results/plan/plan.txt",
    log:
        "logs/plan.log",
    conda:
        "../envs/cpu.yaml"
    params:
        stats=f"{TOKENIZED}/stats.json",
        hidden_states="results/hidden_states",
        layers=LayersSettings.params(config),
        dtype=SETTINGS.extract.content.dtype,
        storage=SETTINGS.extract.content.storage,
        plan=config["plan"],
        reference=SETTINGS.validate.reference,
        windows=SETTINGS.validate.windows,
        gpus=get_gpus(),
        export_copy=SETTINGS.export.speculators
        and SETTINGS.export.hidden_states == "copy",
        validate_device=SETTINGS.validate.device,
        sample_rows=SETTINGS.validate.sample_rows,
    script:
        "../scripts/plan.py"
