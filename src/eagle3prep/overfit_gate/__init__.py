"""The overfit gate (`validate.overfit_gate`, rule overfit_gate; docs/DESIGN.md §6a): an end-to-end check
of the target, the layer ids and the capture by training a draft on a few of the target's own replies and
serving it in vLLM. `stage.run_overfit_gate_job` is the job; `acceptance` the numbers and the bound; `rows`
the gate's rows; `serve` vLLM; `train` speculators' trainer in a child process.

Nothing is imported here: the job's modules need vLLM and the trainer, the report reads the JSON only.
"""
