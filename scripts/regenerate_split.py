import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (open for the whole job)
os.dup2(sys.stderr.fileno(), 2)

from eagle3prep.errors import one_line_errors
from eagle3prep.infra.log import get_logger
from eagle3prep.prepare import require_conversations
from eagle3prep.regenerate import split_conversations

with one_line_errors():
    require_conversations(snakemake.input.counts, snakemake.input.quarantine)
    split = split_conversations(snakemake.input.conversations, list(snakemake.params.shards))
    get_logger("regenerate_split").info(f"{split['rows']} conversations -> {len(split['shards'])} prompt shards")
