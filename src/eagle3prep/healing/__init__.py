"""Heal the results folder with the same command: what the next run redoes and why (heal), and how Snakemake's own
rules redo it (tickets: the heal job's ticket, one more input of each job to redo)."""
