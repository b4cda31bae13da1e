"""What a run of the workflow does around the stages, for rules/common.smk: the parse-time checks of the model and
sources (parse), the user's command line (command), what the jobs need of this Python (environment), whether this
is a run or a dry run (mode), the running jobs' progress (progress) and what a run's end says (closing). Healing
(eagle3prep.healing), the config record (eagle3prep.made_by), the report's staleness (eagle3prep.report.stale) and
the plan (eagle3prep.plan) live with their own concern; every path is in eagle3prep.paths.
No stage imports this folder but for command, which messages use to suggest the user's own command."""
