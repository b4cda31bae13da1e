# Manifest, checksums, row and token identity, shapes, finite values, per-layer statistics,
# and a transformers recomputation of sampled rows. The job fails when a check fails.
rule validate:
    input:
        shard=paths.shard_dir(),
        tokenized=TOKENIZED,
        model=get_model(),
        ticket=heal_ticket("validate/{k}"),
        environment=GUARD.input("validate", validation_runs),
    output:
        report(
            paths.validation_json(),
            caption="../report/validation.rst",
            category="Validation",
            labels={"shard": "{k}"},
        ),
    log:
        paths.log("validate/shard_{k}"),
    benchmark:
        paths.benchmark("validate/shard_{k}")
    conda:
        "../envs/cpu.yaml"
    resources:
        gpus=get_validate_gpus(),
        gpu=get_validate_gpus(),
    params:
        tokens=get_tokenized_shard,
        # without overfit_gate (its own rule's): the key must not re-queue every shard's validation
        validate={k: v for k, v in config["validate"].items() if k != "overfit_gate"},
        trust_remote_code=SETTINGS.model.trust_remote_code,
    script:
        "../scripts/validate.py"


# Checksums only (`snakemake verify`): every shard's files, and the export's, against their manifests;
# one line per damaged file, then a summary; the job fails when one is damaged (eagle3prep.verify).
# No input or output: Snakemake makes nothing first and re-queues no job, and always runs this one.
rule verify:
    log:
        paths.log("verify"),
    localrule: True
    conda:
        "../envs/cpu.yaml"
    threads: 4
    script:
        "../scripts/verify.py"
