"""A one-node Slurm cluster on localhost for the SLURM executor tests (Debian's slurm-wlm 22.05).

Everything but the config lives in one scratch folder: its own munge key and socket, its own ports,
state and logs. The config goes to Slurm's default path, /etc/slurm/slurm.conf, as on a real cluster:
the executor's job step strips SLURM_CONF (with every SLURM_* variable but a few) before its inner
`srun`, which then finds no cluster anywhere else. A config we did not write is never overwritten.
A munge or Slurm already running is neither used nor touched (other socket, other ports). The
daemons run as root in the foreground, as our children, and are stopped by PID. No accounting
database: clients poll with squeue, which sees finished jobs for MinJobAge seconds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

NODE = "eagle3prep-node"
PARTITION = "debug"
CTLD_PORT, SLURMD_PORT = 16817, 16818  # not the default 6817/6818, so a real Slurm on the host is left alone
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scancel")
CONF = Path("/etc/slurm/slurm.conf")
MARK = "# Written by eagle3prep tests/testkit/slurm_cluster.py for a test cluster on localhost; removed after it.\n"


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def foreign_config() -> bool:
    """A slurm.conf that this module did not write: a real cluster's, left alone."""
    return CONF.exists() and not CONF.read_text().startswith(MARK)


def node_resources() -> tuple[int, int]:
    """(CPUs, RealMemory MB) to declare: all CPUs, 90 % of RAM (slurmd drains a node that has less than declared)."""
    return os.cpu_count() or 1, int(psutil.virtual_memory().total / 2**20 * 0.9)


def slurm_conf(root: Path) -> str:
    cpus, mem_mb = node_resources()
    return f"""{MARK}\
ClusterName=eagle3prep-test
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
# No cgroups (containers rarely allow them): plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Start a job as soon as it is submitted or a slot frees, not on the next 60 s scheduling pass.
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1,sched_min_interval=0
# squeue must still list a finished job when the executor polls (the plugin wants >= 3 x its first wait).
MinJobAge=300
ReturnToService=2
NodeName={NODE} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    """Start munged, slurmctld and slurmd under `root`; `env` points Slurm clients at this cluster."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = CONF
        self.env = {"SLURM_CONF": str(CONF)}
        self.procs: list[subprocess.Popen] = []

    def _start(self, name: str, *cmd: str) -> None:
        with open(self.root / f"{name}.out", "w") as out:  # the child keeps its own copy of the fd
            self.procs.append(
                subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
            )

    def client(self, *cmd: str) -> str:
        return subprocess.run(
            cmd, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30, check=True
        ).stdout

    def start(self, timeout: float = 60) -> LocalSlurm:
        for d in ("state", "spool"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        if foreign_config():
            raise RuntimeError(f"{CONF} belongs to another Slurm installation; not overwriting it")
        CONF.parent.mkdir(parents=True, exist_ok=True)
        CONF.write_text(slurm_conf(self.root))
        subprocess.run(["mungekey", "--create", "--keyfile", str(self.root / "munge.key")], check=True)
        # --force: munged refuses to run as root otherwise; -F keeps it in the foreground, our child.
        self._start(
            "munged",
            "munged",
            "-F",
            "--force",
            f"--socket={self.root}/munge.socket",
            f"--key-file={self.root}/munge.key",
            f"--pid-file={self.root}/munged.pid",
            f"--seed-file={self.root}/munged.seed",
            f"--log-file={self.root}/munged.log",
        )
        self._wait(lambda: (self.root / "munge.socket").exists(), timeout, "munged socket")
        self._start("slurmctld", "slurmctld", "-D", "-i", "-f", str(self.conf))
        self._start("slurmd", "slurmd", "-D", "-N", NODE, "-f", str(self.conf))
        self._wait(self._idle, timeout, f"node {NODE} idle in sinfo")
        return self

    def _idle(self) -> bool:
        try:
            return self.client("sinfo", "-h", "-n", NODE, "-o", "%t").strip() == "idle"
        except subprocess.CalledProcessError:
            return False

    def _wait(self, ready, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > end:
                raise RuntimeError(f"local Slurm: no {what} after {timeout:.0f} s (exited: {dead})\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        parts = []
        for name in ("munged.out", "slurmctld.out", "slurmd.out", "slurmctld.log", "slurmd.log"):
            p = self.root / name
            if p.is_file():
                parts.append(f"--- {name}\n" + p.read_text()[-3000:])
        return "\n".join(parts)

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.client("scancel", "--user", "root")  # jobs left by a failed test
        for p in reversed(self.procs):  # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if not foreign_config():
            CONF.unlink(missing_ok=True)
