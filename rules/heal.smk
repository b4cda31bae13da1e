# What healing found (eagle3prep.healing) carried out before the jobs it redoes: failed shards set aside, the last
# report marked stale, and this run's heal ticket, which those jobs take as one more input. In the DAG only when a
# job is redone; onstart hands it the jobs.
rule heal:
    output:
        HEALING.path,
    log:
        paths.log(f"heal/{HEALING.next}"),
    localrule: True
    conda:
        "../envs/cpu.yaml"
    script:
        "../scripts/heal.py"
