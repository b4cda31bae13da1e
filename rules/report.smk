# One HTML report with plots, a CSV summary, and the dataset-level manifest.
# No config in params: what the config decided is in the inputs (counts, stats, manifests,
# validations), so a config edit reruns the report only through the jobs it reruns, and the
# `-n` reason line names those inputs instead of printing the config.


rule report:
    input:
        validations=expand("results/validation/shard_{k}.json", k=SHARDS),
        shards=get_shard_dirs(),
        # prepare's counts, or the regenerate stage's (which hold prepare's totals too)
        counts=f"{CONVERSATIONS}/counts.json",
        tokenized=TOKENIZED,
        # its tokenizer renders the report's sample rows
        model=get_model(),
        # The speculators export when requested: the report then waits for it and records it.
        export=(["results/export/speculators"] if SETTINGS.export.speculators else []),
    output:
        html=report(
            "results/report/report.html",
            caption="../report/report_html.rst",
            category="Report",
        ),
        summary=report(
            "results/report/summary.csv",
            caption="../report/summary_csv.rst",
            category="Dataset",
            labels={"file": "per-shard summary"},
        ),
        manifest=report(
            "results/report/dataset_manifest.json",
            caption="../report/dataset_manifest.rst",
            category="Dataset",
            labels={"file": "dataset manifest"},
        ),
    log:
        "logs/report.log",
    benchmark:
        "benchmarks/report.tsv"
    conda:
        "../envs/cpu.yaml"
    params:
        stats=f"{TOKENIZED}/stats.json",
        token_freq=f"{TOKENIZED}/token_freq.json",
        tokens=get_tokenized_shards(),
        benchmarks=expand("benchmarks/extract/shard_{k}.tsv", k=SHARDS),
    script:
        "../scripts/report.py"
