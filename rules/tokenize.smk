# Chat template + assistant loss mask, global row ids, contiguous shards (DESIGN.md §3).
rule tokenize:
    input:
        # results/prepared/, or results/regenerated/ with regenerate.enabled
        conversations=f"{CONVERSATIONS}/conversations.jsonl",
        # Read first: no conversation kept stops the run here, naming the sources and the quarantine.
        counts=f"{CONVERSATIONS}/counts.json",
        quarantine=f"{CONVERSATIONS}/quarantine.jsonl",
        model=get_model(),
    output:
        # shard_{k}.jsonl for every k, stats.json, token_freq.json, quarantine.jsonl
        directory(TOKENIZED),
    log:
        paths.log("tokenize"),
    benchmark:
        paths.benchmark("tokenize")
    conda:
        "../envs/cpu.yaml"
    # Worker processes that render the chat template (capped by --cores).
    threads: SETTINGS.tokenize.workers
    params:
        # tokenize.chat_template_kwargs, when set: a template change, it re-runs the job
        **get_template_kwargs_params(),
        shards=get_tokenized_shards(),
        max_seq_len=SETTINGS.tokenize.max_seq_len,
        template_fallback=SETTINGS.tokenize.template_fallback,
        trust_remote_code=SETTINGS.model.trust_remote_code,
    script:
        "../scripts/tokenize.py"
