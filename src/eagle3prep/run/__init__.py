"""What a run of the workflow does around the stages, for rules/common.smk and a few rules: the parse-time checks
of the model and sources (parse), the user's command line (command), which config made results/ (made_by),
what the next run redoes (heal) and what a run's end says (closing, stale); the plan is a stage of its own
(eagle3prep.plan).
No stage imports this folder but for command, which messages use to suggest the user's own command, stale,
which the report reads for the set-aside shards, and heal, whose files_seen record validation writes."""
