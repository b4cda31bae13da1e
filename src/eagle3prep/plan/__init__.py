"""The plan stage (`snakemake plan`): what a config's run will write and how long it will take, before any GPU job.

Modules:
    estimate  bytes per shard, free space, job time, a shard size; the plan's text
    bill      every byte the run leaves under results/ and each stage's time, from what finished shards measured
    stage     the job: which tokenized shards it plans (another config's in a scratch folder), the plan written
"""
