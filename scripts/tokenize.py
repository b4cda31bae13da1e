import os
import sys

sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115 (open for the whole job)
os.dup2(sys.stderr.fileno(), 2)  # child processes (vLLM workers, tokenizers) log there too

from eagle3prep.config import schema_default
from eagle3prep.errors import one_line_errors
from eagle3prep.prepare import require_conversations
from eagle3prep.tokenize import tokenize_conversations

with one_line_errors():
    require_conversations(snakemake.input.counts, snakemake.input.quarantine)
    tokenize_conversations(
        snakemake.input.conversations,
        snakemake.input.model,
        out_shards=list(snakemake.params.shards),
        stats_path=f"{snakemake.output[0]}/stats.json",
        token_freq_path=f"{snakemake.output[0]}/token_freq.json",
        quarantine_path=f"{snakemake.output[0]}/quarantine.jsonl",
        max_seq_len=snakemake.params.max_seq_len,
        template_fallback=snakemake.params.template_fallback,
        trust_remote_code=snakemake.params.trust_remote_code,
        workers=snakemake.threads,
        # a param only when set (TokenizeSettings.template_kwargs_params)
        chat_template_kwargs=snakemake.params.get(
            "chat_template_kwargs", schema_default("tokenize", "chat_template_kwargs")
        ),
    )
