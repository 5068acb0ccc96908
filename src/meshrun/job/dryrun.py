"""What a `meshrun train` dry run resolves, as data: ``meshrun.train(dry_run=True)`` returns it
(in its TrainResult), and `meshrun train --dry-run` prints it, as text or (``--json``) as one
JSON object. Nothing starts and nothing is written."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..cluster.topology import Topology
from ..config import TrainConfig
from ..launch.command import Command
from ..launch.dryrun import ProcessPlan, dry_run_dict, dry_run_lines, processes


@dataclass(frozen=True, repr=False)
class DryRun:
    """The job this node would start, and what its ranks will decide.

    ``config``: the TrainConfig the ranks get, every option resolved (its ``sources`` say where
    each value came from). ``topology``: where it runs (platform, nodes, processes per node,
    master). ``job``: the job's options (max_restarts, rdzv_timeout, ...), by name.
    ``decisions``: what the ranks will decide, the keys of ``--dry-run --json``: ``strategy``,
    ``micro_batch``, ``global_batch``, ``accumulation``, ``activation_checkpointing``,
    ``compile``, ``kernels``, ``precision``, ``strategy_from``, ``micro_batch_from``, ``reasons``
    and ``decided_for`` (``decided_for`` None and ``not_decided`` saying why, when this machine's
    GPU memory could not be read). ``summary``: those decisions as the text's comment lines.
    ``command``: the processes with the variables meshrun sets for each (``argv`` and
    ``processes`` give them as lists of strings)."""

    config: TrainConfig
    topology: Topology
    job: Mapping[str, Any]
    decisions: Mapping[str, Any]
    summary: tuple[str, ...]
    command: Command

    @property
    def processes(self) -> list[ProcessPlan]:
        """Each process: ``argv`` (the program as found on PATH) and ``env`` (the variables
        meshrun sets for it)."""
        return processes(self.command)

    @property
    def argv(self) -> list[str]:
        """The first process's command line (torchrun's, on several nodes; rank 0's on one)."""
        found = self.processes
        return found[0]["argv"] if found else []

    def to_dict(self) -> dict[str, Any]:
        """The object `meshrun train --dry-run --json` prints."""
        t = self.topology
        told = {"job": dict(self.job),
                "topology": {"platform": t.platform, "nnodes": t.nnodes, "node_rank": t.node_rank,
                             "nproc_per_node": t.nproc_per_node, "master_addr": t.master_addr,
                             "master_port": t.master_port, "hosts": t.hosts, "run_id": t.run_id}}
        return dry_run_dict(self.command, {**told, **self.decisions})

    def text(self) -> str:
        """What `meshrun train --dry-run` prints: the decisions as comment lines, then the
        processes as shell text, wrapped (launch/dryrun.py)."""
        return "\n".join(dry_run_lines(self.command, self.summary))

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        """A line, not every field of the config (print() shows the whole)."""
        d, t = self.decisions, self.topology
        return (f"DryRun(strategy={d.get('strategy')!r}, micro_batch={d.get('micro_batch')!r}, nnodes={t.nnodes}, "
                f"nproc_per_node={t.nproc_per_node}, argv={self.argv!r})")
