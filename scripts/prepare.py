import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (the log stays open for the job)
os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM workers, tokenizers) log there too

import shutil

from eagle3prep.config import schema_default
from eagle3prep.errors import UserError, one_line_errors
from eagle3prep.infra.log import get_logger
from eagle3prep.prepare import prepare, summarize
from eagle3prep.prepare.counts import loss_error
from eagle3prep.prepare.images import ImageOptions
from eagle3prep.settings import IMAGE_KEYS

with one_line_errors():
    counts = prepare(
        list(snakemake.params.sources),
        snakemake.output.conversations,
        snakemake.output.quarantine,
        snakemake.output.counts,
        max_line_bytes=int(snakemake.params.max_line_bytes),
        allow_no_user_turn=bool(getattr(snakemake.params, "allow_no_user_turn", False)),  # a param only when true
        # the image keys are params only when set (not at their defaults), like allow_no_user_turn
        images=ImageOptions.of({k: getattr(snakemake.params, k) for k in IMAGE_KEYS if hasattr(snakemake.params, k)}),
    )
    get_logger("prepare").info(summarize(counts))
    # Read from the config, not a param: the share decides no byte, so changing it re-queues no job.
    max_share = (
        getattr(snakemake, "config", {})
        .get("data", {})
        .get("max_quarantine_share", schema_default("data", "max_quarantine_share"))
    )
    # A failed job loses its outputs: the quarantine is copied beside the log first, for the user to study.
    kept_copy = os.path.splitext(snakemake.log[0])[0] + ".quarantine.jsonl"
    if error := loss_error(counts, float(max_share), kept_copy):
        shutil.copyfile(snakemake.output.quarantine, kept_copy)
        raise UserError(error)
