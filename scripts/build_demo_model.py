import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (open for the whole job)
os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM workers, tokenizers) log there too

from eagle3prep.demo import build_demo_model

build_demo_model(snakemake.output[0], snakemake.input.corpus)
