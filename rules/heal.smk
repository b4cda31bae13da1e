# This run's heal ticket (eagle3prep.run.tickets): failed shards set aside and the last report marked stale, then
# the ticket, the one more input of every job healing redoes. Local: it moves folders the submit host sees.
rule heal:
    output:
        ".eagle3prep/heal/{n}.json",
    log:
        "logs/heal/{n}.log",
    localrule: True
    conda:
        "../envs/cpu.yaml"
    script:
        "../scripts/heal.py"
