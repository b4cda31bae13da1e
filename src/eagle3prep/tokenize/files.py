"""The model folder's tokenizer files, checked before transformers reads them: without a vocabulary file it builds
an empty tokenizer for some families, and the run failed later on what looked like a chat template problem."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

# The files a tokenizer's vocabulary is read from (fast tokenizers, SentencePiece, BPE, WordPiece, tiktoken).
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "tekken.json", "vocab.json", "merges.txt", "vocab.txt", "*.model",
               "*.tiktoken")  # fmt: skip


def missing_tokenizer_files(model_path: str | os.PathLike, trust_remote_code: bool) -> str | None:
    """The one line that names the missing files when the folder holds no vocabulary file, else None. transformers
    then builds an empty tokenizer for some families (Qwen2, GPT-2) and the run was refused for its chat template,
    then its {% generation %} block. A tokenizer of the model's own code (auto_map, trust_remote_code) may read
    files of any name: not checked."""
    folder = Path(model_path)
    if any(next(folder.glob(pattern), None) for pattern in VOCAB_FILES):
        return None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        if trust_remote_code and "AutoTokenizer" in config.get("auto_map", {}):
            return None
    return (
        f"{model_path}: the folder has no tokenizer files (no tokenizer.json, tokenizer.model, vocab.json and "
        "merges.txt, vocab.txt or *.tiktoken); copy the model's tokenizer files (tokenizer.json, "
        "tokenizer_config.json, chat_template.jinja if it has one) into the folder"
    )
