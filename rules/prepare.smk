# Read every source, normalize roles, drop exact duplicates, quarantine bad records with a reason.
rule prepare:
    input:
        SOURCES,
    output:
        conversations="results/prepared/conversations.jsonl",
        quarantine="results/prepared/quarantine.jsonl",
        counts="results/prepared/counts.json",
    params:
        sources=config["data"]["sources"],
        max_line_bytes=config["data"]["max_line_bytes"],
    log:
        "logs/prepare.log",
    benchmark:
        "benchmarks/prepare.tsv"
    script:
        "../scripts/prepare.py"
