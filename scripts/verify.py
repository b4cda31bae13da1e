import sys

from eagle3prep.errors import one_line_errors
from eagle3prep.verify import VerifyJobSettings, VerifyPaths, run_verify_job

# Each damaged file and the summary to the terminal (what the user ran it for); the summary to the log too.
with one_line_errors():
    # the shards python -m eagle3prep.verify checks too (verify.dataset_shards)
    paths = VerifyPaths("results", snakemake.log[0])
    verdict = run_verify_job(paths, VerifyJobSettings.from_config(snakemake.config, threads=snakemake.threads))
sys.exit(0 if verdict.ok else 1)
