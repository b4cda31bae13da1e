"""What a run of the workflow does around the stages, for rules/common.smk and a few rules: the parse-time checks
of the model and sources (parse), the user's command line (command), which config made results/ (made_by),
what the next run redoes (heal), the plan of the extract jobs (plan) and what a run's end says (closing, stale).
No stage imports this folder but for command, which messages use to suggest the user's own command, and stale,
which the report reads for the set-aside shards."""
