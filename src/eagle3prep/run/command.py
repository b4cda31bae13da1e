"""The user's own `snakemake` command, so that every command the workflow suggests (verify's, validation's, heal's)
is one the user can paste: it keeps the flags that choose the config and the results folder.

The Snakefile reads the command line once, in the main process, and hands it to the jobs in an environment
variable (jobs inherit the main process's environment; a rule param would re-queue every finished job).
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import COMMAND_ENV as ENV

# The flags that decide which workflow, config and folder a command works on; the rest (--cores, -n, targets)
# is the user's choice for each command. The flags that take several values come first: a target typed after
# `--configfile a.yaml` would be read as a config file.
KEPT = ("configfile", "config", "snakefile", "directory", "profile", "workflow_profile")
CONFIGFILE_FLAGS = ("--configfile", "--configfiles")


@dataclass(frozen=True, slots=True)
class Command:
    """What the user typed: the executable, the kept flags ({flag: values as typed}, in KEPT's order), and
    --configfile groups that a later --configfile flag replaced (Snakemake reads only the last flag's files)."""

    executable: str = "snakemake"
    flags: dict[str, list[str]] = field(default_factory=dict)
    dropped_configfiles: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return shlex.join([self.executable, *(a for flag, values in self.flags.items() for a in (flag, *values))])

    def setting(self, flag: str, *values: str) -> Command:
        """This command with `flag` given `values` (replacing its own), e.g. another --directory."""
        return Command(self.executable, {**self.flags, flag: list(values)}, self.dropped_configfiles)

    def adding(self, flag: str, *values: str) -> Command:
        """This command with `values` after the flag's own (another --config key=value): a second flag of the
        same name would replace the first's values."""
        return self.setting(flag, *self.flags.get(flag, []), *values)


def _executable(argv0: str) -> str:
    """`snakemake` when that is what PATH finds, else the path the user typed (.venv/bin/snakemake)."""
    if os.path.basename(argv0) != "snakemake":
        return "snakemake"  # python -m snakemake, or the API
    found = shutil.which("snakemake")
    if found and os.path.realpath(found) == os.path.realpath(argv0):
        return "snakemake"
    return argv0


def from_argv(argv: Sequence[str]) -> Command:
    """The Command of a `snakemake` command line (sys.argv), read with Snakemake's own argument parser; a line
    it cannot read gives the bare executable."""
    from snakemake.cli import get_argument_parser

    try:
        args = get_argument_parser().parse_args(list(argv[1:]))
    except SystemExit:  # argparse exits on a line it cannot read; Snakemake itself would have stopped first
        return Command(_executable(argv[0]) if argv else "snakemake")
    flags: dict[str, list[str]] = {}
    for dest in KEPT:
        value = getattr(args, dest, None)
        if value in (None, [], ""):
            continue
        flags["--" + dest.replace("_", "-")] = [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return Command(_executable(argv[0]), flags, _dropped_configfiles(argv[1:]))


def _dropped_configfiles(args: Sequence[str]) -> list[str]:
    """The files of every --configfile flag but the last: Snakemake's parser keeps only the last flag's."""
    groups: list[list[str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in CONFIGFILE_FLAGS:
            group = []
            while i + 1 < len(args) and not args[i + 1].startswith("-"):
                i += 1
                group.append(args[i])
            groups.append(group)
        elif arg.startswith(tuple(f"{f}=" for f in CONFIGFILE_FLAGS)):
            groups.append([arg.split("=", 1)[1]])
        i += 1
    return [f for group in groups[:-1] for f in group]


def export(command: Command) -> None:
    """Hand the command to the jobs (the main process calls this at parse time)."""
    os.environ[ENV] = str(command)


def known() -> bool:
    """Whether a run handed its command down (else same_command() is a bare `snakemake`)."""
    return bool(os.environ.get(ENV))
