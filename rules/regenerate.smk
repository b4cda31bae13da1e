# Opt-in (regenerate.enabled): the target writes the assistant replies (on-policy data), between prepare and
# tokenize (DESIGN.md §3a). One vLLM job per prompt shard, like extract; its folder is finished with its manifest.
if REGEN.workflow.enabled:

    # prepare, keeping records without an assistant turn (the target writes the replies). A rule of its own:
    # the prepare rule, and the jobs it made, stay exactly as they were when the stage is off.
    ruleorder: prepare_prompt_only > prepare

    rule prepare_prompt_only:
        input:
            SOURCES,
            environment=GUARD.input(
                "prepare_prompt_only", missing(paths.prepared("counts.json"))
            ),
        output:
            conversations=paths.prepared("conversations.jsonl"),
            quarantine=paths.prepared("quarantine.jsonl"),
            counts=paths.prepared("counts.json"),
        log:
            paths.log("prepare"),
        benchmark:
            paths.benchmark("prepare")
        conda:
            "../envs/cpu.yaml"
        params:
            sources=SETTINGS.data.sources,
            max_line_bytes=SETTINGS.data.max_line_bytes,
            allow_prompt_only=True,
        script:
            "../scripts/prepare_prompt_only.py"

    # The prepared conversations cut into contiguous prompt shards (one folder: see TOKENIZED in common.smk).
    rule regenerate_split:
        input:
            conversations=paths.prepared("conversations.jsonl"),
            # Read first: no conversation kept stops the run here, before any engine starts.
            counts=paths.prepared("counts.json"),
            quarantine=paths.prepared("quarantine.jsonl"),
        output:
            directory(REGEN_PROMPTS),
        log:
            paths.log("regenerate/split"),
        benchmark:
            paths.benchmark("regenerate/split")
        conda:
            "../envs/cpu.yaml"
        params:
            shards=expand(paths.regen_prompt_shard(), k=REGEN_SHARDS),
        script:
            "../scripts/regenerate_split.py"

    # The GPU rule of the stage: `gpus` and `gpu` declared like extract's, so --resources caps both.
    rule regenerate:
        input:
            prompts=REGEN_PROMPTS,
            model=get_model(),
            environment=GUARD.input(
                "regenerate", missing(f"{paths.regen_shard()}/{paths.MANIFEST}")
            ),
        output:
            directory(paths.regen_shard()),
        log:
            paths.log("regenerate/shard_{k}"),
        benchmark:
            paths.benchmark("regenerate/shard_{k}")
        conda:
            "../envs/gpu.yaml"
        threads: REGEN.speed.threads
        resources:
            gpus=get_regen_gpus(),
            gpu=get_regen_gpus(),
        params:
            prompts=get_regen_prompt_shard,
            regenerate=get_regen_data_params(),
            # the default of regenerate.max_model_len: tokenize cuts rows there
            max_seq_len=SETTINGS.tokenize.max_seq_len,
            trust_remote_code=SETTINGS.model.trust_remote_code,
        script:
            "../scripts/regenerate.py"

    # The shards joined, each checked against its manifest; rows in = regenerated + quarantined.
    rule regenerate_merge:
        input:
            shards=expand(paths.regen_shard(), k=REGEN_SHARDS),
            counts=paths.prepared("counts.json"),
        output:
            conversations=paths.prepared("conversations.jsonl", paths.REGENERATED),
            quarantine=paths.prepared("quarantine.jsonl", paths.REGENERATED),
            counts=paths.prepared("counts.json", paths.REGENERATED),
        log:
            paths.log("regenerate/merge"),
        benchmark:
            paths.benchmark("regenerate/merge")
        conda:
            "../envs/cpu.yaml"
        script:
            "../scripts/regenerate_merge.py"

    # Not part of `all`: `snakemake regenerate_review` regenerates (if needed) and shows a sample beside
    # the originals, before any extract job runs.
    rule regenerate_review:
        input:
            prepared=paths.prepared("conversations.jsonl"),
            regenerated=paths.prepared("conversations.jsonl", paths.REGENERATED),
            counts=paths.prepared("counts.json", paths.REGENERATED),
        output:
            paths.prepared("review.txt", paths.REGENERATED),
        log:
            paths.log("regenerate/review"),
        conda:
            "../envs/cpu.yaml"
        params:
            n=REGEN.workflow.review_samples,
        script:
            "../scripts/regenerate_review.py"
