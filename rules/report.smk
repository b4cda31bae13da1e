# One HTML report with plots, a CSV summary, and the dataset-level manifest.
# No config in params: what the config decided is in the inputs (counts, stats, manifests,
# validations), so a config edit reruns the report only through the jobs it reruns, and the
# `-n` reason line names those inputs instead of printing the config.


rule report:
    input:
        validations=expand(paths.validation_json(), k=SHARDS),
        shards=get_shard_dirs(),
        # prepare's counts, or the regenerate stage's (which hold prepare's totals too)
        counts=f"{CONVERSATIONS}/counts.json",
        tokenized=TOKENIZED,
        # its tokenizer renders the report's sample rows
        model=get_model(),
        # The speculators export when requested: the report then waits for it and records it.
        export=([paths.EXPORT] if SETTINGS.export.speculators else []),
    output:
        html=report(
            paths.REPORT,
            caption="../report/report_html.rst",
            category="Report",
        ),
        summary=report(
            paths.SUMMARY,
            caption="../report/summary_csv.rst",
            category="Dataset",
            labels={"file": "per-shard summary"},
        ),
        manifest=report(
            paths.DATASET_MANIFEST,
            caption="../report/dataset_manifest.rst",
            category="Dataset",
            labels={"file": "dataset manifest"},
        ),
    log:
        paths.log("report"),
    benchmark:
        paths.benchmark("report")
    conda:
        "../envs/cpu.yaml"
    params:
        stats=f"{TOKENIZED}/stats.json",
        token_freq=f"{TOKENIZED}/token_freq.json",
        tokens=get_tokenized_shards(),
        benchmarks=expand(paths.benchmark("extract/shard_{k}"), k=SHARDS),
    script:
        "../scripts/report.py"
