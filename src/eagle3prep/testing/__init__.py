"""Fixtures for the tests and benches, kept out of the stages (tests/test_hygiene.py checks no stage imports them).

- tiny_models, tiny_kimi, tiny_vl: deterministic tiny random targets built offline (`python -m
  eagle3prep.testing.tiny_models OUT`); tiny_vl also writes the demo's images.
- planted: copies of a correct shard made wrong the ways real capture code goes wrong.
- matrix: the validation matrix's cell (capture, validate every row, then each planted mistake).
- stdlib_target, stdlib_corpus: the quality bench's target, a Llama trained on the Python standard library
  (`python -m eagle3prep.testing.stdlib_target OUT`); peer_files: another tool's per-row hidden-state files
  rebuilt into our shards and judged by validation.
- image_rows: synthetic conversations with Pillow-drawn images, made into tokenized shards by prepare and tokenize.
- writers: test-only writers and references (a whole layer file, transformers' prompt logprobs, a CaptureSpec
  from a config).

The demo's own model builder is eagle3prep.demo: the build_demo_model rule runs it.
"""
