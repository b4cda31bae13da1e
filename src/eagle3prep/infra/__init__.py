"""Shared infrastructure the stages use, none of it about the data: crash-safe writes (atomic.py), disk
space (disk.py), sizes and durations in words (units.py), GPU claims (gpus.py), vLLM's leftover shared
memory (shm.py), Snakemake's lock after a kill (runlock.py), kill points for crash tests (faults.py) and the
identity every manifest records (provenance.py). Nothing is imported here, so `from eagle3prep.infra import
runlock` stays cheap at parse."""
