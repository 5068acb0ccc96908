"""A real Slurm cluster on this machine, for tests: munge, one slurmctld and two slurmd
"nodes", each daemon in its own network namespace with its own address (tests/netns.py),
its own host name (a UTS namespace) and its own /etc/hosts, so a job's steps on node2
really run on another "host" than node1's. No GPUs: jobs use gloo.

Each daemon enters its namespace with ``nsenter --net`` rather than ``ip netns exec``:
the latter remounts /sys, which hides the cgroup hierarchy slurmd's cgroup plugin needs
at start-up even with proctrack/linuxproc. Every file (configuration, munge key and
socket, state, spool, logs) lives in one private directory; nothing under /etc is touched.

Accounting: ``jobcomp/filetxt`` records each finished job, and ``sacct -c`` reads it
(no slurmdbd or database needed); ``MinJobAge`` keeps finished jobs in ``scontrol``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import netns

NODES = ("node1", "node2")
HEAD = "slurmhead"
CPUS_PER_NODE = 4  # what slurm.conf declares (config_overrides): 2 tasks x 2 CPUs


def available() -> str | None:
    """None when a cluster can be started here, else why not."""
    why = netns.available()
    if why:
        return why
    missing = [p for p in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sacct", "nsenter", "unshare")
               if shutil.which(p) is None]
    return f"needs {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)" if missing else None


@dataclass
class SlurmCluster:
    root: Path
    hosts: list[netns.Host]  # [head, node1, node2]
    env: dict[str, str]  # what clients and jobs see: SLURM_CONF, PATH, ...
    switch: str
    daemons: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> str:
        return str(self.root / "slurm.conf")

    def in_host(self, index: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``index``: its network, its host name, its /etc/hosts."""
        name = (HEAD, *NODES)[index]
        setup = f'mount --bind {self.root}/hosts /etc/hosts && hostname {name} && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{self.hosts[index].netns}", "unshare", "--mount", "--uts",
                "sh", "-c", setup, "sh", *argv]

    def run(self, argv: list[str], timeout: float, host: int = 0, env: dict[str, str] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        """A client command (sbatch, srun, salloc, scontrol, sacct) run on the head host."""
        return subprocess.run(self.in_host(host, argv), env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout, cwd=cwd)

    def popen(self, argv: list[str], host: int = 0, env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.Popen:
        return subprocess.Popen(self.in_host(host, argv), env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=cwd)

    def sbatch(self, script: str, cwd: str, env: dict[str, str] | None = None) -> int:
        """Submit; the job sees the cluster's environment plus ``env`` (sbatch's --export=ALL)."""
        out = self.run(["sbatch", "--parsable", script], timeout=30, cwd=cwd, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed: {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as key=value pairs ({} once Slurm has forgotten it)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)], timeout=30)
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}

    def wait(self, job_id: int, timeout: float, until: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED",
                                                                           "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                                                                           "PREEMPTED", "BOOT_FAIL", "DEADLINE"),
             output: Path | None = None) -> dict[str, str]:
        """Poll (bounded) until the job's state is one of ``until``; returns its record. Past
        ``timeout`` the job is cancelled and the error holds its record, the tail of its
        ``output`` file and of the daemons' logs: what it was doing, for a failure seen
        only in CI."""
        end = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < end:
            info = self.job(job_id)
            if info.get("JobState") in until:
                return info
            time.sleep(0.5)
        self.run(["scancel", str(job_id)], timeout=30)
        record = " ".join(f"{k}={info.get(k)}" for k in ("JobState", "Reason", "Restarts", "RunTime", "BeginTime"))
        tail = "\n".join(output.read_text(errors="replace").splitlines()[-40:]) if output and output.exists() else ""
        raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s ({record})\n"
                           f"--- job output\n{tail}\n{self.logs()[-3000:]}")

    def accounting(self, job_id: int) -> list[str]:
        """The states ``sacct -c`` (job completion records) lists for the job, oldest first."""
        out = self.run(["sacct", "-c", "-n", "-P", "-j", str(job_id), "-o", "State"], timeout=30)
        return [s.strip() for s in out.stdout.splitlines() if s.strip()]

    def logs(self) -> str:
        text = []
        for name in ("slurmctld.log", *[f"slurmd-{n}.log" for n in NODES]):
            p = self.root / name
            if p.exists():
                text.append(f"--- {name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(text)


def _conf(root: Path, hosts: list[netns.Host]) -> str:
    nodes = "\n".join(f"NodeName={n} NodeAddr={h.addr} CPUs={CPUS_PER_NODE} State=UNKNOWN"
                      for n, h in zip(NODES, hosts[1:]))
    return f"""ClusterName=meshruntest
SlurmctldHost={HEAD}({hosts[0].addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock,cred_expire=5
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
MinJobAge=3600
KillWait=10
MessageTimeout=20
SlurmdTimeout=60
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def start(root: Path, tag: str, subnet: int, base_env: dict[str, str], timeout: float = 60) -> SlurmCluster:
    """Start munge, slurmctld and two slurmd; return once both nodes are idle (bounded by
    ``timeout``). On any failure everything started is torn down before raising."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o711)  # munged refuses a socket directory others may write to
    names = {HEAD: 0, **{n: i + 1 for i, n in enumerate(NODES)}}
    hosts = netns.create_hosts(tag, subnet=subnet, n=3, names=names)
    with open(root / "hosts", "w") as f:
        f.write("127.0.0.1 localhost\n" + "".join(f"{hosts[i].addr} {n}\n" for n, i in names.items()))
    (root / "slurm.conf").write_text(_conf(root, hosts))
    (root / "state").mkdir(exist_ok=True)
    (root / "spool").mkdir(exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    env = {**base_env, "SLURM_CONF": str(root / "slurm.conf")}
    cluster = SlurmCluster(root, hosts, env, f"mr{tag}sw")
    try:
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={root}/munge.sock",
                        f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                        f"--seed-file={root}/munge.seed"], check=True, capture_output=True, timeout=30)
        cluster.daemons.append(subprocess.Popen(cluster.in_host(0, ["slurmctld", "-D", "-f", cluster.conf]),
                                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for i, n in enumerate(NODES):
            slurmd = cluster.in_host(i + 1, ["slurmd", "-D", "-N", n, "-f", cluster.conf])
            cluster.daemons.append(subprocess.Popen(slurmd, env=env, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL))
        end = time.monotonic() + timeout
        while True:
            out = cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30)
            states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in NODES):
                return cluster
            if time.monotonic() > end:
                raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s ({states}): {cluster.logs()}")
            time.sleep(0.5)
    except BaseException:
        stop(cluster)
        raise


def stop(cluster: SlurmCluster) -> None:
    """Kill every daemon and job process started, remove the namespaces; never raises."""
    for p in cluster.daemons:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in cluster.daemons:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    netns.destroy(cluster.hosts, cluster.switch)  # also SIGKILLs job steps left in the namespaces
    try:
        pid = int((cluster.root / "munged.pid").read_text().strip())
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass
