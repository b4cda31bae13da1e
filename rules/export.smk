# Opt-in (export.speculators): the layout vllm-project/speculators trains from (DESIGN.md §7).
# It copies every hidden-state byte; HiddenStatesDataset (src/eagle3prep/dataset.py) avoids the copy.
rule export_speculators:
    input:
        validations=expand("results/validation/shard_{k}.json", k=SHARDS),
        shards=get_shard_dirs(),
        tokenized=TOKENIZED,
    output:
        directory("results/export/speculators"),
    log:
        "logs/export/speculators.log",
    benchmark:
        "benchmarks/export/speculators.tsv"
    conda:
        "../envs/base.yaml"
    params:
        tokens=get_tokenized_shards(),
    script:
        "../scripts/export.py"
