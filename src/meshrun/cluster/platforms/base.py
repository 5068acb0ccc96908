"""The contract of a platform: the base class every built-in platform and every user's extends.

A platform is where meshrun runs (a scheduler, a cloud service, a launcher, a plain machine),
recognised by the variables it sets. To teach meshrun one it does not know, subclass
:class:`Platform` and register the subclass (see ``meshrun.cluster.userplatforms``)::

    from meshrun.cluster.envread import EnvReader
    from meshrun.cluster.platforms.base import Platform
    from meshrun.cluster.topology import Topology

    class Borg(Platform):
        NAME = "borg"
        MARKERS = "BORG_TASK_COUNT and BORG_TASK_INDEX"

        def detect(self, env, gpus):
            r = EnvReader(env)
            if not r.has("BORG_TASK_COUNT", "BORG_TASK_INDEX"):
                return None
            return Topology(platform=self.NAME, nnodes=r.need_int("BORG_TASK_COUNT", "nnodes", minimum=1),
                            node_rank=r.need_int("BORG_TASK_INDEX", "node_rank"), nproc_per_node=max(gpus, 1),
                            master_addr=r.str_or("BORG_LEADER", "master_addr", ""), master_port=29500,
                            sources=r.sources)
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import ClassVar

from ..topology import Topology

DEFAULT_MASTER_HINT = "pass --master-addr (or set MASTER_ADDR) to node 0's address"


class Platform(abc.ABC):
    """One platform meshrun can detect.

    ``NAME`` is what ``meshrun env`` shows and ``--platform`` takes; ``MARKERS`` says in words
    which variables :meth:`detect` looks for (messages quote it: ``detected (SLURM_JOB_ID
    set)``); ``MASTER_HINT`` is the hint of the error a multi-node job gets when the platform
    names no master address. Subclasses are created with no arguments.
    """

    NAME: ClassVar[str]
    MARKERS: ClassVar[str]
    MASTER_HINT: ClassVar[str] = DEFAULT_MASTER_HINT

    @abc.abstractmethod
    def detect(self, env: Mapping[str, str], gpus: int) -> Topology | None:
        """This node's Topology, or None when the platform's marker variables are absent.

        Return a Topology (``platform=NAME``, ``sources`` saying where each value came from,
        as :class:`meshrun.cluster.envread.EnvReader` records them) when the markers are
        present and consistent; raise :class:`meshrun.errors.MeshrunError` (``bad_value``)
        naming the variable when they are present but wrong. Pure: read only ``env`` (not
        ``os.environ``) and ``gpus`` (the GPUs visible on this node).
        """
