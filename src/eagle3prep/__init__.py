"""eagle3prep: chat data -> tokenized rows -> per-layer hidden-state shards for EAGLE-3 drafts.

Heavy dependencies (torch, transformers, vllm) are imported inside the functions that use them,
so `import eagle3prep` stays cheap in every environment.
"""

__version__ = "0.1.0"
