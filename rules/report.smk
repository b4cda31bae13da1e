# One HTML report with plots, a CSV summary, and the dataset-level manifest.
rule report:
    input:
        validations=expand("results/validation/shard_{k}.json", k=SHARDS),
        shards=get_shard_dirs(),
        counts="results/prepared/counts.json",
        stats="results/tokenized/stats.json",
        tokens=expand("results/tokenized/shard_{k}.jsonl", k=SHARDS),
    output:
        html="results/report/report.html",
        summary="results/report/summary.csv",
        manifest="results/report/dataset_manifest.json",
    log:
        "logs/report.log",
    benchmark:
        "benchmarks/report.tsv"
    conda:
        "../envs/base.yaml"
    params:
        benchmarks=expand("benchmarks/extract/shard_{k}.tsv", k=SHARDS),
        config=config,
    script:
        "../scripts/report.py"
