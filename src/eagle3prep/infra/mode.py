"""What this Snakemake process will do with its jobs, read where executor plugins read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Mode:
    """A run, a dry run, or a command that builds the DAG and runs nothing (--summary, --dag: `executor` False)."""

    executor: bool  # a run or a dry run
    dry: bool = False
    touch: bool = False  # --touch: outputs are marked up to date, nothing is redone
    local: bool = True  # jobs run on this host (False: --executor slurm and the like)

    @property
    def jobs_run(self) -> bool:
        return self.executor and not self.dry

    @classmethod
    def of(cls, workflow: object) -> Mode:
        """From `workflow.executor_plugin.common_settings`: the CommonSettings of snakemake-interface-executor-plugins,
        the stable interface between Snakemake and its executors (dryrun_exec, touch_exec, non_local_exec). Snakemake
        sets the plugin before it builds the DAG of a run or dry run; --summary, --dag and --lint have none."""
        plugin = getattr(workflow, "executor_plugin", None)
        if plugin is None:
            return cls(executor=False)
        common = plugin.common_settings
        return cls(executor=True, dry=common.dryrun_exec, touch=common.touch_exec, local=not common.non_local_exec)
