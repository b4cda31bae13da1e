"""speculators' trainer on the CPU, for tests: it hard-requires an accelerator, CI has none.

speculators 0.9.0's Trainer moves the model and every batch with `.to(local_rank)` (an int: cuda:<rank>;
on a CPU-only torch "Cannot access accelerator device when none is available"), runs the forward under
`torch.autocast(device_type)` with device_type "cuda" when no accelerator exists (autocast then turns
itself off with a warning), and its step timer calls `torch.accelerator.synchronize()`, which raises
without one. Three patches put all of it on the CPU, with bf16 autocast on as on a GPU; the data
path, model, loss, optimizer and schedule are speculators' own code, unchanged. Single process, so
no process group is made (torchrun is not used here).
"""

from __future__ import annotations

import torch


def run_trainer_on_cpu(monkeypatch) -> None:
    """Patch speculators' trainer for the CPU with pytest's `monkeypatch` (undone after the test)."""
    import speculators.train.trainer as trainer

    assert not torch.accelerator.is_available(), "this shim is for CPU-only hosts; on a GPU run unpatched"
    monkeypatch.setattr(trainer, "get_local_rank", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: None)
    init = trainer.Trainer.__init__

    def init_on_cpu(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"  # autocast(cpu, bf16) as autocast(cuda, bf16) on a GPU

    monkeypatch.setattr(trainer.Trainer, "__init__", init_on_cpu)
