# Opt-in (validate.overfit_gate): a draft overfit on the target's own greedy replies to a few prompts of
# shard 0, served by vLLM on them, must accept nearly every drafted token (DESIGN.md §6a). After shard 0's
# validation; the other shards do not wait for it (an edge into extract would re-queue every finished
# shard whenever the gate is turned on or off): `snakemake overfit_gate` runs it, and what it needs, first.
if SETTINGS.validate.overfit_gate:

    rule overfit_gate:
        input:
            validation="results/validation/shard_0.json",
            shard="results/hidden_states/shard_0",
            tokenized=TOKENIZED,
            model=get_model(),
            environment=GUARD.input(
                "overfit_gate", missing("results/validation/overfit_gate.json")
            ),
        output:
            "results/validation/overfit_gate.json",
        log:
            "logs/validate/overfit_gate.log",
        benchmark:
            "benchmarks/validate/overfit_gate.tsv"
        # Its engines and training before the other shards' extract jobs when they compete for GPUs.
        priority: 10
        conda:
            "../envs/gpu.yaml"
        threads: SETTINGS.extract.speed.threads
        # its engines' tensor-parallel size, or the capture's when larger (overfit_gate.stage.job_gpus)
        resources:
            gpus=max(get_regen_gpus(), get_gpus()),
            gpu=max(get_regen_gpus(), get_gpus()),
        params:
            tokens=f"{TOKENIZED}/shard_0.jsonl",
            work="results/overfit_gate",
            layers=LayersSettings.params(config),
            extract=get_extract_data_params(),
            # the engine settings of the regenerate stage (used whether or not it is enabled)
            regenerate=get_regen_data_params(),
            trust_remote_code=SETTINGS.model.trust_remote_code,
        script:
            "../scripts/overfit_gate.py"

    # The report with the gate's verdict: a rule of its own (as prepare_prompt_only is), so that with the
    # gate off the report rule, and the jobs it made, stay exactly as they were. The report's own
    # inputs, outputs and params, and the gate's JSON.
    ruleorder: report_with_gate > report

    rule report_with_gate:
        input:
            **rules.report.input,
            gate="results/validation/overfit_gate.json",
        output:
            **rules.report.output,
        log:
            "logs/report.log",
        benchmark:
            "benchmarks/report.tsv"
        conda:
            "../envs/cpu.yaml"
        params:
            **rules.report.params,
        script:
            "../scripts/report.py"
