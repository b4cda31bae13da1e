"""What leaves the pipeline for training (DESIGN.md §7): the speculators export (speculators.py, the export rule)
and a torch Dataset over the shards themselves for a training script of your own (dataset.py)."""

from eagle3prep.export.speculators import (
    ExportError,
    ExportJobSettings,
    ExportPaths,
    check_shards,
    export_speculators,
    run_export_job,
)

__all__ = ["ExportError", "ExportJobSettings", "ExportPaths", "check_shards", "export_speculators", "run_export_job"]
