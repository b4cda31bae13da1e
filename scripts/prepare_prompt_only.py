# prepare with regenerate.enabled: records without an assistant turn are kept (the target writes the replies).
# The prepare_prompt_only rule runs it, so that the prepare rule and scripts/prepare.py stay as they were.
import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (the log stays open for the job)
os.dup2(sys.stderr.fileno(), 2)

from eagle3prep.errors import one_line_errors
from eagle3prep.infra.log import get_logger
from eagle3prep.prepare import prepare, summarize
from eagle3prep.prepare.counts import check_losses

with one_line_errors():
    counts = prepare(
        list(snakemake.params.sources),
        snakemake.output.conversations,
        snakemake.output.quarantine,
        snakemake.output.counts,
        max_line_bytes=int(snakemake.params.max_line_bytes),
        allow_prompt_only=bool(snakemake.params.allow_prompt_only),
    )
    get_logger("prepare").info(summarize(counts))
    # A file that lost all or most of its rows stops the run here, as in scripts/prepare.py (data.max_quarantine_share).
    check_losses(counts, getattr(snakemake, "config", {}), snakemake.output.quarantine, snakemake.log[0])
