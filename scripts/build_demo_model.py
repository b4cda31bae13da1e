import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (open for the whole job)

from eagle3prep.demo import build_demo_model

build_demo_model(snakemake.output[0], snakemake.input.corpus)
