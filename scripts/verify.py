import sys

from eagle3prep.errors import one_line_errors
from eagle3prep.verify import verify

# Each damaged file and the summary to the terminal (what the user ran it for); the summary to the log too.
with one_line_errors():
    verdict = verify("results", list(snakemake.params.shards), snakemake.threads)
    verdict.write_record("results")  # the next run of the workflow redoes what it found damaged
    for line in verdict.damaged:
        print(line, file=sys.stderr)
    summary = verdict.summary("results")
    print(summary, file=sys.stderr)
    with open(snakemake.log[0], "w", encoding="utf-8") as log:
        print(summary, file=log)
sys.exit(0 if verdict.ok else 1)
