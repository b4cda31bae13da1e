"""What the tests and benches share, kept out of the package that ships (tests/test_hygiene.py checks it).

Tests import it as `testkit` (pytest puts tests/ on the path); a bench puts tests/ on sys.path first, and a
command line runs a builder as `PYTHONPATH=tests python -m testkit.tiny_models OUT`.

- tiny_models, tiny_kimi, tiny_vl: deterministic tiny random targets built offline; tiny_vl also writes the
  demo's images.
- planted: copies of a correct shard made wrong the ways real capture code goes wrong.
- matrix: the validation matrix's cell (capture, validate every row, then each planted mistake).
- stdlib_target, stdlib_corpus: the quality bench's target, a Llama trained on the Python standard library;
  peer_files: another tool's per-row hidden-state files rebuilt into our shards and judged by validation.
- image_rows: synthetic conversations with Pillow-drawn images, made into tokenized shards by prepare and tokenize;
  image_run: a finished run of them up to validation.
- writers, shards: test-only writers and references (a whole layer file, a shard, transformers' prompt logprobs, a
  CaptureSpec from a config); regenerate: a fake engine and a one-shard job; workflow: a Snakemake run of the
  small config; slurm_cluster: a one-node Slurm cluster on localhost; train_both, speculators_cpu: speculators'
  trainer on CPU over both exports; vllm_contract: the vLLM sources the registry is checked against; rounds: the
  benches' round ratios; calls: validate_shard, prepare and tokenize_conversations with the config values a
  test does not name taken from the typed settings.

The demo's own model builder is eagle3prep.demo: the build_demo_model rule runs it.
"""
