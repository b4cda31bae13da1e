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
                "prepare_prompt_only", missing("results/prepared/counts.json")
            ),
        output:
            conversations="results/prepared/conversations.jsonl",
            quarantine="results/prepared/quarantine.jsonl",
            counts="results/prepared/counts.json",
        log:
            "logs/prepare.log",
        benchmark:
            "benchmarks/prepare.tsv"
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
            conversations="results/prepared/conversations.jsonl",
            # Read first: no conversation kept stops the run here, before any engine starts.
            counts="results/prepared/counts.json",
            quarantine="results/prepared/quarantine.jsonl",
        output:
            directory(REGEN_PROMPTS),
        log:
            "logs/regenerate/split.log",
        benchmark:
            "benchmarks/regenerate/split.tsv"
        conda:
            "../envs/cpu.yaml"
        params:
            shards=expand(f"{REGEN_PROMPTS}/shard_{{k}}.jsonl", k=REGEN_SHARDS),
        script:
            "../scripts/regenerate_split.py"

    # The GPU rule of the stage: `gpus` and `gpu` declared like extract's, so --resources caps both.
    rule regenerate:
        input:
            prompts=REGEN_PROMPTS,
            model=get_model(),
            environment=GUARD.input(
                "regenerate", missing("results/regenerate/shard_{k}/manifest.json")
            ),
        output:
            directory("results/regenerate/shard_{k}"),
        log:
            "logs/regenerate/shard_{k}.log",
        benchmark:
            "benchmarks/regenerate/shard_{k}.tsv"
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
            shards=expand("results/regenerate/shard_{k}", k=REGEN_SHARDS),
            counts="results/prepared/counts.json",
        output:
            conversations="results/regenerated/conversations.jsonl",
            quarantine="results/regenerated/quarantine.jsonl",
            counts="results/regenerated/counts.json",
        log:
            "logs/regenerate/merge.log",
        benchmark:
            "benchmarks/regenerate/merge.tsv"
        conda:
            "../envs/cpu.yaml"
        script:
            "../scripts/regenerate_merge.py"

    # Not part of `all`: `snakemake regenerate_review` regenerates (if needed) and shows a sample beside
    # the originals, before any extract job runs.
    rule regenerate_review:
        input:
            prepared="results/prepared/conversations.jsonl",
            regenerated="results/regenerated/conversations.jsonl",
            counts="results/regenerated/counts.json",
        output:
            "results/regenerated/review.txt",
        log:
            "logs/regenerate/review.log",
        conda:
            "../envs/cpu.yaml"
        params:
            n=REGEN.workflow.review_samples,
        script:
            "../scripts/regenerate_review.py"
