import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (open for the whole job)
os.dup2(sys.stderr.fileno(), 2)

from eagle3prep.errors import one_line_errors
from eagle3prep.infra.atomic import atomic_open
from eagle3prep.infra.log import get_logger
from eagle3prep.regenerate.review import review

with one_line_errors():
    text = review(snakemake.input.prepared, snakemake.input.regenerated, n=int(snakemake.params.n), width=160)
    with atomic_open(snakemake.output[0], "w", encoding="utf-8") as f:
        f.write(text)
    get_logger("regenerate_review").info(snakemake.output[0])
