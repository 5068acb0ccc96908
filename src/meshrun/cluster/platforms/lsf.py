"""IBM Spectrum LSF jobs, whose processes jsrun (LSF's Job Step Manager) or blaunch starts.

LSF sets LSB_JOBID in every job. The job's hosts come from LSB_DJOB_RANKFILE, a file with one
host name per line and one line per slot (a host appears once for each slot it gives the job),
else from LSB_MCPU_HOSTS, the same slots as ``host1 n1 host2 n2 ...`` pairs. The first slot
is the launch (batch) node, where the job script runs; on clusters with jsrun it runs no job
step, so it is dropped, as Lightning's LSFEnvironment and the usual jsrun recipes
(``uniq $LSB_DJOB_RANKFILE | tail -n +2``) do. The remaining hosts, each once, in the order
LSF lists them, are the compute nodes in node-rank order. Dropping the first slot rather than
the first host keeps a first host that gives the job more slots (where the job script runs on
the first compute node), and a job of a single slot keeps its one host.

jsrun gives each process JSM_NAMESPACE_SIZE, JSM_NAMESPACE_RANK and JSM_NAMESPACE_LOCAL_RANK
(and JSM_NAMESPACE_LOCAL_SIZE). With one task per node (``jsrun -n N -r 1 -a 1 meshrun
launch ...``) each task is a node's launcher and its namespace rank is the node rank. With
several per node, each task is already a worker: jsrun packs ranks node by node (its default
``-d packed``), so the node index is rank // tasks per node, which holds only when the local
rank is rank % tasks per node; another placement is refused, as it would give two processes
one torch rank. Tasks per node is JSM_NAMESPACE_LOCAL_SIZE, else the task count over the
host count.

blaunch (LSF's own task launcher, on any LSF cluster) gives each task it starts LSF_PM_TASKID,
its number from 1 in the order of the hosts blaunch was given (Open MPI's LSF launch relies on
this order too). A plain LSF cluster has no launch node: the job script runs on the first
execution host, which computes too. So a blaunch task (LSF_PM_TASKID set, no JSM_* or Open
MPI variables) is node LSF_PM_TASKID - 1 of the job's hosts, each once, in order, none dropped
(``all_hosts``), which is the list ``meshrun render lsf`` gives ``blaunch -u``; a task number
past them (blaunch with no host list, one task per slot) is refused.

Without JSM_* variables or LSF_PM_TASKID this process is not in a job step: it is the job
script itself. A job whose one compute host is the batch host (``bsub -n 8 meshrun train``) is that one node;
otherwise the process runs on the launch node, or on one of several nodes with nothing that
says which, and is refused. mpirun inside an LSF job (OMPI_COMM_WORLD_* without JSM_*) is left
to the ``mpi`` platform: mpirun placed that process.

The master is the first compute host unless MASTER_ADDR is set. The port, unless MASTER_PORT
is set, comes from the job id as Slurm's does (15000 + id % 10000, below Linux's ephemeral
range), plus the array index (LSB_JOBINDEX) so elements of one job array sharing a node do not
collide. LSB_DJOB_RANKFILE is the one file a detector reads: LSF gives the slot list that way.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...errors import bad_value
from ..envread import EnvReader
from ..topology import Topology
from ._common import per_node_default
from .base import Platform

MARKERS = "LSB_JOBID"  # what detect() looks for
NAME = "lsf"
JSM_VARS = ("JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_LOCAL_SIZE")
MAX_RANKFILE_BYTES = 64 << 20  # far above any job's slot list; bounds a path that names no rankfile
JSRUN_HINT = ("start meshrun on every compute node: blaunch -u <file of the hosts, each once> meshrun ..., "
              "jsrun -n <nodes> -r 1 -a 1 meshrun ... (IBM CSM), or mpirun --map-by ppr:1:node "
              "-x MASTER_ADDR=<first compute host> meshrun ...; meshrun render lsf writes the job script")
BLAUNCH_HINT = ("start one task on each host: blaunch -u FILE with the job's hosts, each once, in LSF's order "
                "(meshrun render lsf writes it)")


def port_from_job_id(job_id: int, index: int = 0) -> int:
    return 15000 + (job_id + index) % 10000


def read_rankfile(path: str) -> list[str]:
    """Host names of LSB_DJOB_RANKFILE, one per slot, blanks around them and empty lines dropped."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RANKFILE_BYTES + 1)
    except OSError as exc:
        raise bad_value("env LSB_DJOB_RANKFILE", path, f"cannot be read ({exc.strerror or exc})",
                        "LSF writes it for the job; run meshrun inside the job, or unset the variable") from None
    if len(data) > MAX_RANKFILE_BYTES:
        raise bad_value("env LSB_DJOB_RANKFILE", path, f"is larger than {MAX_RANKFILE_BYTES >> 20} MiB",
                        "it should list one host per slot of the job; check the path")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_value("env LSB_DJOB_RANKFILE", path, "is not a text file of host names",
                        "it should list one host per line; check the path") from None
    hosts = [line.strip() for line in text.splitlines() if line.strip()]
    if not hosts:
        raise bad_value("env LSB_DJOB_RANKFILE", path, "lists no host", "it should list one host per slot of the job")
    bad = next((h for h in hosts if len(h.split()) != 1), None)
    if bad is not None:
        raise bad_value("env LSB_DJOB_RANKFILE", path, f"has a line that is not one host name: {bad!r}",
                        "it should list one host per line")
    return hosts


def parse_mcpu_hosts(text: str) -> list[tuple[str, int]]:
    """``host1 4 host2 4`` -> [(host1, 4), (host2, 4)]."""
    words = text.split()
    pairs: list[tuple[str, int]] = []
    if words and len(words) % 2 == 0:
        for host, count in zip(words[::2], words[1::2]):
            if not count.isdigit() or int(count) < 1:
                break
            pairs.append((host, int(count)))
        else:
            return pairs
    raise bad_value("env LSB_MCPU_HOSTS", text, "is not pairs of a host and its slot count",
                    "LSF sets it like 'host1 4 host2 4'")


def slots_of(hosts: list[str]) -> list[tuple[str, int]]:
    """A rankfile's lines as (host, consecutive slots) pairs."""
    pairs: list[tuple[str, int]] = []
    for host in hosts:
        if pairs and pairs[-1][0] == host:
            pairs[-1] = (host, pairs[-1][1] + 1)
        else:
            pairs.append((host, 1))
    return pairs


def compute_hosts(slots: list[tuple[str, int]]) -> tuple[str, ...]:
    """The job's hosts without the launch node's slot (the first), each once, in order; the one
    host of a single-slot job."""
    first, count = slots[0]
    rest = ([(first, count - 1)] if count > 1 else []) + slots[1:]
    hosts = tuple(dict.fromkeys(host for host, _ in rest))
    return hosts or (first,)


def all_hosts(slots: list[tuple[str, int]]) -> tuple[str, ...]:
    """The job's hosts, each once, in order, the first included: a blaunch task's node list."""
    return tuple(dict.fromkeys(host for host, _ in slots))


def job_slots(r: EnvReader) -> tuple[list[tuple[str, int]], str]:
    """The job's (host, slots) pairs and the variable they came from."""
    if r.has("LSB_DJOB_RANKFILE"):
        var = "LSB_DJOB_RANKFILE"
        slots = slots_of(read_rankfile(r.env["LSB_DJOB_RANKFILE"].strip()))
    elif r.has("LSB_MCPU_HOSTS"):
        var = "LSB_MCPU_HOSTS"
        slots = parse_mcpu_hosts(r.env["LSB_MCPU_HOSTS"])
    else:
        raise bad_value("env LSB_DJOB_RANKFILE", "", "is unset, and LSB_MCPU_HOSTS too: the job's hosts are unknown",
                        "LSF sets both in a job; run meshrun inside the job, or unset LSB_JOBID")
    return slots, var


def job_hosts(r: EnvReader) -> tuple[tuple[str, ...], str, str]:
    """(compute hosts, the variable they came from, the launch node)."""
    slots, var = job_slots(r)
    return compute_hosts(slots), var, slots[0][0]


def blaunch_task(r: EnvReader, gpus: int, job_id: int, index: int) -> Topology:
    """A task blaunch started: node LSF_PM_TASKID - 1 of all the job's hosts."""
    slots, var = job_slots(r)
    hosts = all_hosts(slots)
    task = r.need_int("LSF_PM_TASKID", minimum=1)
    if task > len(hosts):
        raise bad_value("env LSF_PM_TASKID", task, f"is past the {len(hosts)} host(s) of env {var}: blaunch started "
                        "more than one task per host", BLAUNCH_HINT)
    r.note("hosts", f"env {var} (each host once, the first included)")
    r.note("nnodes", f"count of hosts of env {var}")
    r.note("node_rank", "env LSF_PM_TASKID - 1")
    nproc, src = per_node_default(gpus)
    r.note("nproc_per_node", src)
    return _topology(r, hosts, var, task - 1, nproc, None, job_id, index)


def detect(env: Mapping[str, str], gpus: int) -> Topology | None:
    r = EnvReader(env)
    if not r.has("LSB_JOBID"):
        return None
    in_step = r.any(*JSM_VARS)
    if not in_step and r.any("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        return None  # mpirun inside the job placed this process: the mpi platform reads it
    job_id = r.need_int("LSB_JOBID", "run_id")
    index = r.opt_int("LSB_JOBINDEX") or 0
    if not in_step and r.has("LSF_PM_TASKID"):
        return blaunch_task(r, gpus, job_id, index)
    hosts, var, launch_node = job_hosts(r)
    r.note("hosts", f"env {var} (its first slot, the launch node, dropped)")
    local_rank = None
    if not in_step:
        if len(hosts) > 1 or hosts[0] != launch_node:
            raise bad_value("env JSM_NAMESPACE_RANK", "",
                            f"is unset: this is the job script on the launch node {launch_node}, not a job step "
                            f"on one of the {len(hosts)} compute host(s) of env {var}", JSRUN_HINT)
        nnodes, node_rank = 1, 0
        r.note("nnodes", f"count of env {var}")
        r.note("node_rank", "default (one node)")
        nproc, src = per_node_default(gpus)
        r.note("nproc_per_node", src)
    else:
        size = r.need_int("JSM_NAMESPACE_SIZE", minimum=1)
        rank = r.need_int("JSM_NAMESPACE_RANK")
        if rank >= size:
            raise bad_value("env JSM_NAMESPACE_RANK", rank, f"must be below JSM_NAMESPACE_SIZE={size}")
        jsm_local_rank = r.need_int("JSM_NAMESPACE_LOCAL_RANK")
        local_size = r.opt_int("JSM_NAMESPACE_LOCAL_SIZE", minimum=1)
        local_src = "env JSM_NAMESPACE_LOCAL_SIZE"
        if local_size is None:
            if size % len(hosts):
                raise bad_value("env JSM_NAMESPACE_SIZE", size,
                                f"is not a multiple of the {len(hosts)} compute host(s) of env {var}",
                                "start the same number of tasks on every node (jsrun -r 1 -a <tasks per node>)")
            local_size = size // len(hosts)
            local_src = f"env JSM_NAMESPACE_SIZE / compute hosts of env {var}"
        if size % local_size:
            raise bad_value("env JSM_NAMESPACE_SIZE", size,
                            f"is not a multiple of JSM_NAMESPACE_LOCAL_SIZE={local_size}",
                            "start the same number of tasks on every node (jsrun -r 1 -a <tasks per node>)")
        nnodes = size // local_size
        if nnodes != len(hosts):
            raise bad_value("env JSM_NAMESPACE_SIZE", size,
                            f"is {nnodes} node(s) of {local_size} task(s), but env {var} lists {len(hosts)} "
                            "compute host(s)", "run the job step on every compute host: jsrun -n <nodes> -r 1 ...")
        if local_size == 1:
            if jsm_local_rank != 0:
                raise bad_value("env JSM_NAMESPACE_LOCAL_RANK", jsm_local_rank,
                                f"but one task per node ({local_src}): tasks are not spread evenly over the nodes",
                                "start the same number of tasks on every node (jsrun -r 1 -a <tasks per node>)")
            node_rank = rank
            r.note("nnodes", "env JSM_NAMESPACE_SIZE (one task per node)")
            r.note("node_rank", "env JSM_NAMESPACE_RANK")
            nproc, src = per_node_default(gpus)
            r.note("nproc_per_node", src)
        else:
            if jsm_local_rank != rank % local_size:
                raise bad_value("env JSM_NAMESPACE_LOCAL_RANK", jsm_local_rank,
                                f"but JSM_NAMESPACE_RANK={rank} with {local_size} per node: ranks are not "
                                "packed node by node, so the node index cannot be derived",
                                "use jsrun's default placement (-d packed), or -a 1 with one launcher per node")
            node_rank, nproc, local_rank = rank // local_size, local_size, jsm_local_rank
            r.note("nnodes", "env JSM_NAMESPACE_SIZE / JSM_NAMESPACE_LOCAL_SIZE" if r.has("JSM_NAMESPACE_LOCAL_SIZE")
                   else f"count of compute hosts of env {var}")
            r.note("node_rank", "env JSM_NAMESPACE_RANK // tasks per node")
            r.note("nproc_per_node", local_src)
            r.note("local_rank", "env JSM_NAMESPACE_LOCAL_RANK")
    return _topology(r, hosts, var, node_rank, nproc, local_rank, job_id, index, nnodes)


def _topology(r: EnvReader, hosts: tuple[str, ...], var: str, node_rank: int, nproc: int, local_rank: int | None,
              job_id: int, index: int, nnodes: int | None = None) -> Topology:
    """The Topology of a node of ``hosts``: the master is the first unless MASTER_ADDR is set,
    the port derived from the job id unless MASTER_PORT is."""
    master = r.opt_str("MASTER_ADDR", "master_addr")
    if master is None:
        master = hosts[0]
        r.note("master_addr", f"first compute host of env {var}")
    derived = "LSB_JOBID + LSB_JOBINDEX (15000 + sum % 10000)" if index else "LSB_JOBID (15000 + id % 10000)"
    port = r.int_or("MASTER_PORT", "master_port", port_from_job_id(job_id, index), minimum=1,
                    default_source=f"derived from env {derived}")
    if index:
        r.note("run_id", "env LSB_JOBID, LSB_JOBINDEX")
    return Topology(
        platform=NAME,
        nnodes=len(hosts) if nnodes is None else nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        master_addr=master,
        master_port=port,
        hosts=hosts,
        run_id=f"{job_id}[{index}]" if index else str(job_id),
        local_rank=local_rank,
        sources=r.sources,
    )


class LSF(Platform):
    NAME = NAME
    MARKERS = MARKERS
    detect = staticmethod(detect)
