import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)

from eagle3prep.errors import one_line_errors
from eagle3prep.healing.tickets import run_heal_job


def say(line):
    # in the log, and on the terminal where the run's other healing lines are
    print(f"[heal] {line}", file=sys.stderr)
    print(f"eagle3prep: {line}", file=sys.__stderr__, flush=True)


with one_line_errors():
    run_heal_job(snakemake.output[0], say=say)
