import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (open for the whole job)
os.dup2(sys.stderr.fileno(), 2)

from eagle3prep.errors import one_line_errors
from eagle3prep.regenerate import merge_shards

with one_line_errors():
    merge_shards(
        list(snakemake.input.shards),
        snakemake.input.counts,
        snakemake.output.conversations,
        snakemake.output.quarantine,
        snakemake.output.counts,
    )
