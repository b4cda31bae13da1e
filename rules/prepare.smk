# Read every source, normalize roles, drop exact duplicates, quarantine bad records with a reason.
rule prepare:
    input:
        SOURCES,
    output:
        conversations="results/prepared/conversations.jsonl",
        quarantine="results/prepared/quarantine.jsonl",
        counts="results/prepared/counts.json",
    log:
        "logs/prepare.log",
    benchmark:
        "benchmarks/prepare.tsv"
    conda:
        "../envs/base.yaml"
    params:
        sources=config["data"]["sources"],
        max_line_bytes=config["data"]["max_line_bytes"],
    script:
        "../scripts/prepare.py"
