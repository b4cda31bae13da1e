# Chat template + assistant loss mask, global row ids, contiguous shards (DESIGN.md §3).
rule tokenize:
    input:
        conversations="results/prepared/conversations.jsonl",
        model=get_model(),
    output:
        shards=expand("results/tokenized/shard_{k}.jsonl", k=SHARDS),
        stats="results/tokenized/stats.json",
        token_freq="results/tokenized/token_freq.json",
        quarantine="results/tokenized/quarantine.jsonl",
    log:
        "logs/tokenize.log",
    benchmark:
        "benchmarks/tokenize.tsv"
    conda:
        "../envs/base.yaml"
    params:
        max_seq_len=config["tokenize"]["max_seq_len"],
        template_fallback=config["tokenize"]["template_fallback"],
        trust_remote_code=config["model"]["trust_remote_code"],
    script:
        "../scripts/tokenize.py"
