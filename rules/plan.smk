# Disk and GPU time before any GPU job runs: bytes per shard, free space, job time, a shard size.
# Not part of `all`: `snakemake plan` (add -f to refresh the free space after freeing disk). It changes nothing
# under results/ but, in a folder with no tokenized shards yet, the run's own first steps (prepare, tokenize);
# another config's shards are tokenized in .eagle3prep/plan/ (eagle3prep.made_by.plan_source).
PLAN_SOURCE = made_by.plan_source(SHARD_KEYS)


rule plan:
    input:
        **({"tokenized": TOKENIZED} if PLAN_SOURCE.from_run else {}),
        model=get_model(),
    output:
        json=f"{paths.PLAN_DIR}/plan.json",
        txt=f"{paths.PLAN_DIR}/plan.txt",
    log:
        paths.log("plan"),
    conda:
        "../envs/cpu.yaml"
    params:
        # what the plan reads when Snakemake does not make it (another config's: made by the job, in scratch)
        **({} if PLAN_SOURCE.from_run else {"tokenized": PLAN_SOURCE.tokenized}),
        prepared=PLAN_SOURCE.prepared,
        hidden_states=paths.HIDDEN_STATES,
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
        # every key that decides the shards: another config's plan is made again
        shard_keys=SHARD_KEYS,
    script:
        "../scripts/plan.py"
