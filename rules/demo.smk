if SETTINGS.model.build_demo:

    # A tiny random Llama and a BPE tokenizer trained on shipped text: the offline demo target.
    rule build_demo_model:
        input:
            corpus="resources/demo/tokenizer_corpus.txt",
        output:
            directory(MODEL),
        log:
            paths.log("build_demo_model"),
        benchmark:
            paths.benchmark("build_demo_model")
        conda:
            "../envs/cpu.yaml"
        script:
            "../scripts/build_demo_model.py"
