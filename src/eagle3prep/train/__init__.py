"""Training an EAGLE-3 draft with vllm-project/speculators' own trainer on our data (docs/guides/training.md):
`rows.py` reads training rows straight from the shard folders, `backend.py` serves them to
speculators as the hidden-states backend `eagle3prep`, `cli.py` is the `eagle3prep-train` command.

Nothing is imported here: `backend` needs speculators' hs_connectors, which the workflow does not.
"""
