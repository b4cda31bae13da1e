#!/usr/bin/env bash
# Debian's Slurm (controller, node daemon, client) and munge, for the one-node cluster that
# tests/test_slurm.py starts on localhost. Accounting (slurmdbd + a database) is not installed:
# the test runs the executor plugin with `--slurm-status-command squeue`, which needs no accounting
# database as long as MinJobAge keeps finished jobs visible (the test's slurm.conf sets it).
# Idempotent: does nothing when slurmctld is already installed. Needs root (CI runs as root).
set -euo pipefail
if command -v slurmctld >/dev/null 2>&1; then
    echo "install-slurm: slurmctld already installed ($(slurmctld -V))"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-slurm: not root, not installing; the Slurm cluster test will be skipped"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# A munged or slurmd that the packages start is left alone: the test cluster uses its own munge
# socket and its own ports, and Debian ships no slurm.conf, so the packaged slurmctld/slurmd stay down.
apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
slurmctld -V
