import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)
os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM workers, tokenizers) log there too

from eagle3prep.errors import one_line_errors
from eagle3prep.validate import validate_shard

with one_line_errors(oom_fix="set validate.device: cpu, or lower validate.sample_rows"):
    opts = snakemake.params.validate
    validate_shard(
        snakemake.input.shard,
        snakemake.params.tokens,
        snakemake.output[0],
        model_path=snakemake.input.model,
        sample_rows=opts["sample_rows"],
        seed=opts["seed"],
        device=opts["device"],
        reference=opts["reference"],
        windows=opts["windows"],
        trust_remote_code=snakemake.params.trust_remote_code,
    )
