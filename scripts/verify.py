import sys

from eagle3prep.errors import one_line_errors
from eagle3prep.verify import report, verify

# Each damaged file and the summary to the terminal (what the user ran it for); the summary to the log too.
with one_line_errors():
    # the shards python -m eagle3prep.verify checks too (verify.dataset_shards)
    verdict = verify("results", threads=snakemake.threads)
    verdict.write_record("results")  # the next run of the workflow redoes what it found damaged
    report(verdict, "results", sys.stderr)
    summary = verdict.summary("results")
    with open(snakemake.log[0], "w", encoding="utf-8") as log:
        print(summary, file=log)
sys.exit(0 if verdict.ok else 1)
