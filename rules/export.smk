# Opt-in (export.speculators): the layout vllm-project/speculators trains from (DESIGN.md §7).
# export.hidden_states: copy (every hidden-state byte once more) or direct (the arrow part only; the
# trainer reads the shard folders through `eagle3prep-train ... --hidden-states-backend eagle3prep`).
rule export:
    input:
        validations=expand(paths.validation_json(), k=SHARDS),
        shards=get_shard_dirs(),
        tokenized=TOKENIZED,
        ticket=heal_ticket("export"),
        environment=GUARD.input("export", export_runs),
    output:
        directory(paths.EXPORT),
    log:
        paths.log("export/speculators"),
    benchmark:
        paths.benchmark("export/speculators")
    conda:
        "../envs/cpu.yaml"
    params:
        tokens=get_tokenized_shards(),
        hidden_states=SETTINGS.export.hidden_states,
    script:
        "../scripts/export.py"
