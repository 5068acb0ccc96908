"""User platforms for tests/test_user_platforms.py: registered through MESHRUN_PLATFORMS or an
entry point of the group meshrun.platforms. Imports no torch (the CLI path stays torch-free)."""

import sys

from meshrun.cluster.envread import EnvReader
from meshrun.cluster.platforms.base import Platform
from meshrun.cluster.topology import Topology


class Borg(Platform):
    """A made-up scheduler: BORG_TASK_COUNT tasks, this one BORG_TASK_INDEX, peers in BORG_HOSTS."""

    NAME = "borg"
    MARKERS = "BORG_TASK_COUNT and BORG_TASK_INDEX"
    MASTER_HINT = "set BORG_HOSTS to every task's host, task 0 first"

    def detect(self, env, gpus):
        r = EnvReader(env)
        if not r.has("BORG_TASK_COUNT", "BORG_TASK_INDEX"):
            return None
        nnodes = r.need_int("BORG_TASK_COUNT", "nnodes", minimum=1)
        hosts = tuple(h.strip() for h in env.get("BORG_HOSTS", "").split(",") if h.strip())
        if hosts:
            r.note("hosts", "env BORG_HOSTS")
            r.note("master_addr", "env BORG_HOSTS (first host)")
        else:
            r.note("master_addr", "default")
        r.note("nproc_per_node", "borg (one process per task)")
        return Topology(
            platform=self.NAME,
            nnodes=nnodes,
            node_rank=r.need_int("BORG_TASK_INDEX", "node_rank"),
            nproc_per_node=1,
            master_addr=hosts[0] if hosts else ("127.0.0.1" if nnodes == 1 else ""),
            master_port=r.int_or("BORG_PORT", "master_port", 29777, minimum=1),
            hosts=hosts,
            run_id=r.str_or("BORG_JOB", "run_id", "borg"),
            sources=r.sources,
        )


class NotAPlatform:
    NAME = "plain"


class Exploding(Platform):
    NAME = "exploding"
    MARKERS = "nothing it can read"

    def detect(self, env, gpus):
        raise RuntimeError("quota service unreachable\nsecond line")


class Exiting(Platform):
    NAME = "exiting"
    MARKERS = "nothing it can read"

    def detect(self, env, gpus):
        sys.exit(0)


class Interrupting(Platform):
    NAME = "interrupting"
    MARKERS = "nothing it can read"

    def detect(self, env, gpus):
        raise KeyboardInterrupt


class Chatty(Platform):
    """Prints as it detects: the output goes to stderr, so `--json` stays one JSON document."""

    NAME = "chatty"
    MARKERS = "nothing it can read"

    def detect(self, env, gpus):
        print("chatty: looking for my variables")
        return None


class SlurmAgain(Platform):
    NAME = "slurm"
    MARKERS = "SLURM_JOB_ID"

    def detect(self, env, gpus):
        return None
