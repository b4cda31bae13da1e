# Opt-in (validate.overfit_gate): a draft overfit on the target's own greedy replies to a few prompts of
# shard 0, served by vLLM on them, must accept nearly every drafted token (DESIGN.md §6a). After shard 0's
# validation; the other shards do not wait for it (an edge into extract would re-queue every finished
# shard whenever the gate is turned on or off): `snakemake overfit_gate` runs it, and what it needs, first.
if SETTINGS.validate.overfit_gate:

    rule overfit_gate:
        input:
            validation=paths.validation_json(0),
            shard=paths.shard_dir(0),
            tokenized=TOKENIZED,
            model=get_model(),
            environment=GUARD.input("overfit_gate", missing(paths.OVERFIT_GATE)),
        output:
            paths.OVERFIT_GATE,
        log:
            paths.log("validate/overfit_gate"),
        benchmark:
            paths.benchmark("validate/overfit_gate")
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
            tokens=paths.tokenized_shard(0),
            work=paths.OVERFIT_GATE_WORK,
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
            gate=paths.OVERFIT_GATE,
        output:
            **rules.report.output,
        log:
            paths.log("report"),
        benchmark:
            paths.benchmark("report")
        conda:
            "../envs/cpu.yaml"
        params:
            **rules.report.params,
        script:
            "../scripts/report.py"
