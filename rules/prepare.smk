# Read every source, normalize roles, drop exact duplicates, quarantine bad records with a reason.
rule prepare:
    input:
        SOURCES,
        environment=GUARD.input("prepare", missing(paths.prepared("counts.json"))),
    output:
        conversations=paths.prepared("conversations.jsonl"),
        quarantine=paths.prepared("quarantine.jsonl"),
        counts=paths.prepared("counts.json"),
    log:
        paths.log("prepare"),
    benchmark:
        paths.benchmark("prepare")
    conda:
        "../envs/cpu.yaml"
    params:
        # data.allow_no_user_turn only when true: a key added after runs existed, so a run made before it is
        # not re-queued (settings.LATER says why)
        **({"allow_no_user_turn": True} if SETTINGS.data.allow_no_user_turn else {}),
        # the image keys likewise only when set, away from their defaults
        **SETTINGS.data.image_params(),
        sources=SETTINGS.data.sources,
        max_line_bytes=SETTINGS.data.max_line_bytes,
    script:
        "../scripts/prepare.py"
