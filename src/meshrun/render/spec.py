"""What to render (a RenderSpec), validated. The renderers are in the modules beside this
one; ``meshrun.render.render`` dispatches to them."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, fields

from ..cluster.topology import MAX_GPUS_PER_NODE, MAX_NODES
from ..errors import bad_value
from ..vocab import FRAMEWORKS
from .volumes import check_volume

TARGETS = ("slurm", "lsf", "skypilot", "kubernetes", "saturn", "hostfile")
# what `render kubernetes --as` writes: an Indexed Job and a headless Service, a Kubeflow
# PyTorchJob (Training Operator v1), a Kubeflow Trainer v2 TrainJob, or a JobSet
K8S_KINDS = ("job", "pytorchjob", "trainjob", "jobset")
SIGNAL_BEFORE_S = 120  # Slurm's warning before the time limit: a step and a snapshot fit in it
SLURM_MAX_SIGNAL_S = 65535  # sbatch --signal=SIG@TIME: TIME is at most this (sbatch(1))
# the longest pod host name of a job on N nodes, after its name, by kind (NAME-i for an Indexed
# Job, NAME-node-0-i under a JobSet and a TrainJob, NAME-worker-i under a PyTorchJob)
_HOST_SUFFIX = {"job": lambda n: f"-{n - 1}", "jobset": lambda n: f"-node-0-{n - 1}",
                "trainjob": lambda n: f"-node-0-{n - 1}", "pytorchjob": lambda n: f"-worker-{max(0, n - 2)}"}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?$")  # room for the pod suffix NAME-i
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS-1123 label
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # no blanks, '%' (sbatch's patterns) or '/'
_PARTITION = re.compile(r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$")  # one partition or a comma list
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # a Slurm account, an LSF project or queue
_QOS = _PARTITION  # one QOS or a comma list
_SLURM_MEM = re.compile(r"^[0-9]+[KMGTkmgt]?$")  # sbatch --mem: a size (MB unless K/M/G/T); 0 takes the node's all
# sbatch --constraint: features joined by & | , with [ ] ( ) grouping and *COUNT; no blanks or quotes
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.\-&|,\[\]()*:]+$")
# --sbatch-arg: one long or short option, its value after '=' (or none); no blanks or quotes,
# which sbatch would split or read as another option
_SBATCH_ARG = re.compile(r"^(--[A-Za-z][A-Za-z0-9-]*(=[^\s'\"\\]+)?|-[A-Za-z](=?[^\s'\"\\]+)?)$")
# the options the rendered script sets itself: its own flags say them, or its launch depends on them
RENDERED_SBATCH = {"--job-name": "--name", "-J": "--name", "--nodes": "--nodes", "-N": "--nodes",
                   "--ntasks-per-node": None, "--ntasks": None, "-n": None, "--gpus-per-node": "--gpus-per-node",
                   "--cpus-per-task": "--cpus-per-task", "-c": "--cpus-per-task", "--partition": "--partition",
                   "-p": "--partition", "--time": "--time", "-t": "--time", "--output": None, "-o": None,
                   "--open-mode": "--requeue", "--requeue": "--requeue", "--signal": "--signal-before",
                   "--account": "--account", "-A": "--account", "--qos": "--qos", "-q": "--qos",
                   "--mem": "--mem", "--constraint": "--constraint", "-C": "--constraint"}
# sbatch options of their own whose names begin a rendered option's (--gpus, --gpus-per-node):
# getopt_long takes an exact name as that option, not as an abbreviation
SBATCH_OWN_PREFIXES = frozenset({"--gpus"})
_LSF_TIME = re.compile(r"([0-9]+:)?[0-9]+")  # bsub -W: [hours:]minutes
# how `render lsf` starts a node's meshrun (--launcher): blaunch on a plain LSF cluster (the
# default), jsrun on an IBM CSM cluster (whose jobs ask for whole nodes), Open MPI's mpirun
LSF_LAUNCHERS = ("blaunch", "jsrun", "mpirun")
# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit
_SLURM_TIME = re.compile(r"([0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2}|UNLIMITED|INFINITE)")
_ACCELERATOR = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)(?::([1-9][0-9]*))?$")  # SkyPilot NAME or NAME:COUNT
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$")  # registry/repo:tag or @digest
_HOST = re.compile(r"^[A-Za-z0-9_.:-]+$")  # a host name, an IPv4 or an IPv6 address
# C0 and C1 controls, DEL, and the characters YAML and str.splitlines treat as line breaks:
# a newline in a field would start a new line in the script or the YAML
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# --setup is a script: its newlines and tabs are its own
_SETUP_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


@dataclass(frozen=True)
class RenderSpec:
    target: str
    command: tuple[str, ...]  # what every node runs (meshrun ... or a script for meshrun launch)
    nodes: int = 2
    gpus_per_node: int = 8
    framework: str = "torch"
    name: str = "meshrun-job"
    image: str | None = None
    accelerator: str = "H100"
    port: int = 29500
    setup: str | None = None
    # Slurm
    partition: str | None = None
    time: str | None = None
    cpus_per_task: int | None = None  # None: no CPU request of the script's own (slurm.py)
    requeue: bool = False  # stop on SIGUSR1 before the time limit, snapshot, requeue the job
    signal_before: int | None = None  # seconds before the time limit; None: SIGNAL_BEFORE_S
    max_restarts: int = 0  # run a failed job step again, up to this many times
    account: str | None = None
    qos: str | None = None
    mem: str | None = None  # per node, sbatch's syntax
    constraint: str | None = None
    sbatch_args: tuple[str, ...] = ()  # more #SBATCH lines, one option each
    # Kubernetes
    namespace: str | None = None
    kind: str = "job"  # job | pytorchjob | trainjob | jobset (K8S_KINDS)
    runtime: str = "torch-distributed"  # a TrainJob's ClusterTrainingRuntime
    volume: str | None = None  # NAME:PATH, a persistent volume mounted on every node (Kubernetes, SkyPilot)
    # LSF
    launcher: str = "blaunch"  # LSF_LAUNCHERS
    # SkyPilot
    workdir: str | None = None  # a local directory SkyPilot uploads to ~/sky_workdir; None: none
    # hostfile
    hosts: tuple[str, ...] = field(default=())

    def node_command(self) -> tuple[str, ...]:
        """``meshrun ...`` as given, else the script wrapped in ``meshrun launch -f FW``."""
        if self.command and self.command[0] == "meshrun":
            return self.command
        head = ("meshrun", "launch") + (("-f", self.framework) if self.framework != "torch" else ())
        return head + self.command

    def shell_command(self) -> str:
        """The node command for a shell: every argument single-quoted where it needs quoting,
        so the shell on the node passes it on byte for byte (``$HOME``, ``$(...)``, backticks
        and quotes stay as the user wrote them; nothing of the submitting host or the node is
        substituted into the user's command)."""
        return shlex.join(self.node_command())


def _no_control(name: str, value: str | None, pattern: re.Pattern[str] = _CONTROL) -> None:
    if value is not None and pattern.search(value):
        raise bad_value(name, value, "contains a control character (a newline, tab or the like)",
                        "give it on one line, without control characters")


def _check_text(spec: RenderSpec) -> None:
    """No control characters in anything that is written into the spec."""
    for flag, value in (("--name", spec.name), ("--image", spec.image), ("--accelerator", spec.accelerator),
                        ("--partition", spec.partition), ("--time", spec.time), ("--namespace", spec.namespace),
                        ("--volume", spec.volume), ("--runtime", spec.runtime), ("--workdir", spec.workdir),
                        ("--launcher", spec.launcher),
                        ("--account", spec.account), ("--qos", spec.qos), ("--mem", spec.mem),
                        ("--constraint", spec.constraint), *(("--sbatch-arg", a) for a in spec.sbatch_args)):
        _no_control(flag, value)
    _no_control("--setup", spec.setup, _SETUP_CONTROL)
    for arg in spec.command:
        _no_control("command", arg)
    for host in spec.hosts:
        _no_control("--hosts", host)


def _check_syntax(spec: RenderSpec) -> None:
    """Each field in the syntax its target reads it in."""
    if spec.target != "kubernetes" and not _JOB_NAME.fullmatch(spec.name):
        raise bad_value("--name", spec.name, "is not a job name (letters, digits, '_', '.', '-'; no blanks)",
                        "e.g. llama-finetune")
    if spec.image is not None and not _IMAGE.fullmatch(spec.image):
        raise bad_value("--image", spec.image, "is not a container image reference",
                        "e.g. ghcr.io/you/train:latest")
    m = _ACCELERATOR.fullmatch(spec.accelerator)
    if not m:
        raise bad_value("--accelerator", spec.accelerator, "is not an accelerator (NAME or NAME:COUNT, COUNT >= 1)",
                        "e.g. H100 or H100:8")
    if spec.target == "skypilot" and m.group(2) and int(m.group(2)) != spec.gpus_per_node:
        raise bad_value("--accelerator", spec.accelerator,
                        f"asks for {m.group(2)} GPUs per node but --gpus-per-node is {spec.gpus_per_node}",
                        f"--accelerator {m.group(1)} --gpus-per-node {m.group(2)}")
    if spec.partition is not None and spec.target == "lsf" and not _SLURM_NAME.fullmatch(spec.partition):
        raise bad_value("--partition", spec.partition, "is not an LSF queue name", "e.g. gpu")
    if spec.partition is not None and not _PARTITION.fullmatch(spec.partition):
        raise bad_value("--partition", spec.partition, "is not a Slurm partition name (or comma-separated list)",
                        "e.g. gpu")
    if spec.time is not None and spec.target == "lsf":
        if not _LSF_TIME.fullmatch(spec.time):
            raise bad_value("--time", spec.time, "is not an LSF run limit", "[hours:]minutes, e.g. 240 or 4:00")
    elif spec.time is not None and not _SLURM_TIME.fullmatch(spec.time):
        raise bad_value("--time", spec.time, "is not a Slurm time limit",
                        "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. 04:00:00 or 2-00:00:00")
    _check_slurm(spec)
    if spec.cpus_per_task is not None and spec.cpus_per_task < 1:
        raise bad_value("--cpus-per-task", spec.cpus_per_task, "must be >= 1",
                        "leave it out to take the partition's default CPUs")
    if spec.namespace is not None and not _NAMESPACE.fullmatch(spec.namespace):
        raise bad_value("--namespace", spec.namespace,
                        "is not a Kubernetes namespace (DNS-1123 label: a-z, 0-9, '-')", "e.g. ml-team")
    for host in spec.hosts:
        if not host:
            raise bad_value("--hosts", ",".join(spec.hosts), "has an empty host name",
                            "separate host names by single commas, e.g. 10.0.0.1,10.0.0.2")
        if not _HOST.fullmatch(host):
            raise bad_value("--hosts", host, "is not a host name or IP address", "e.g. 10.0.0.1 or node-1")
    if spec.target == "hostfile" and spec.gpus_per_node < 1:
        raise bad_value("--gpus-per-node", spec.gpus_per_node, "a hostfile needs at least one slot per host",
                        "e.g. --gpus-per-node 8")


def slurm_seconds(text: str) -> int | None:
    """A Slurm time limit (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in seconds;
    None for no limit (UNLIMITED, INFINITE)."""
    if text in ("UNLIMITED", "INFINITE"):
        return None
    days, _, rest = text.rpartition("-") if "-" in text else ("", "", text)
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-HH[:MM[:SS]]
        h, m, sec = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + sec
    if len(parts) == 1:  # minutes
        return parts[0] * 60
    if len(parts) == 2:  # MM:SS
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]  # HH:MM:SS


def _check_slurm(spec: RenderSpec) -> None:
    """The Slurm job options: Slurm's own syntax, for Slurm alone, and no #SBATCH line that
    repeats (or contradicts) one the script renders from its own flags."""
    if spec.account is not None and spec.target not in ("slurm", "lsf"):
        raise bad_value("--account", spec.account, f"is a Slurm or LSF job option, not one for {spec.target}",
                        "drop it")
    given = [(flag, value) for flag, value in (("--qos", spec.qos), ("--mem", spec.mem),
                                                ("--constraint", spec.constraint)) if value is not None]
    given += [("--sbatch-arg", a) for a in spec.sbatch_args]
    if given and spec.target != "slurm":
        flag, value = given[0]
        raise bad_value(flag, value, f"is a Slurm job option, not one for {spec.target}", "drop it")
    checks = ((spec.account, "--account", _SLURM_NAME, "is not an account (Slurm) or project (LSF) name",
               "e.g. --account ml-team"),
              (spec.qos, "--qos", _QOS, "is not a Slurm QOS name (or comma-separated list)", "e.g. --qos normal"),
              (spec.mem, "--mem", _SLURM_MEM, "is not a Slurm memory size",
               "a number of MB, or with K, M, G or T, e.g. 500G; 0 takes all of each node's memory"),
              (spec.constraint, "--constraint", _CONSTRAINT, "is not a Slurm constraint (features joined by & | ,)",
               "e.g. --constraint 'h100&ib'"))
    for option, flag, pattern, what, hint in checks:
        if option is not None and not pattern.fullmatch(option):
            raise bad_value(flag, option, what, hint)
    for arg in spec.sbatch_args:
        if not _SBATCH_ARG.fullmatch(arg):
            raise bad_value("--sbatch-arg", arg, "is not one sbatch option (--name or --name=value, no blanks "
                            "or quotes)", "e.g. --sbatch-arg=--exclusive or --sbatch-arg=--mail-type=END")
        name = arg.split("=", 1)[0] if arg.startswith("--") else arg[:2]
        abbreviated = sorted(r for r in RENDERED_SBATCH if r.startswith(name) and r != name) \
            if name.startswith("--") and len(name) > 2 and name not in SBATCH_OWN_PREFIXES else []
        if abbreviated and name not in RENDERED_SBATCH:
            # sbatch reads options with getopt_long, which takes any unique prefix of a long option: a
            # shortened name sets the rendered option all the same, and written after it, wins
            ours = [mine for r in abbreviated if (mine := RENDERED_SBATCH[r]) is not None]
            raise bad_value("--sbatch-arg", arg, f"abbreviates {' or '.join(abbreviated)}, which the script renders "
                            "itself (sbatch takes any unique prefix of an option)",
                            f"use meshrun render's {ours[0]} instead" if ours else "leave it to meshrun: its launch "
                            "depends on it")
        if name in RENDERED_SBATCH:
            own = RENDERED_SBATCH[name]
            raise bad_value("--sbatch-arg", arg, "sets an option the script renders itself",
                            f"use meshrun render's {own} instead" if own else "leave it to meshrun: its launch "
                            "depends on it")


def _check_kubernetes(spec: RenderSpec) -> None:
    if spec.kind not in K8S_KINDS:
        raise bad_value("--as", spec.kind, "is not a Kubernetes kind meshrun renders", f"one of {', '.join(K8S_KINDS)}")
    if spec.target != "kubernetes":
        for flag, value, unset in (("--as", spec.kind, "job"), ("--runtime", spec.runtime, "torch-distributed")):
            if value != unset:
                raise bad_value(flag, value, f"is for Kubernetes specs, not {spec.target}", "drop it")
        return
    host = spec.name + _HOST_SUFFIX[spec.kind](max(1, spec.nodes))
    if len(host) > 63:  # a pod's host name is one DNS label
        room = 63 - (len(host) - len(spec.name))
        raise bad_value("--name", spec.name, f"makes the pod host name {host} ({len(host)} characters at {spec.nodes} "
                        "node(s)), over the 63 a DNS label takes", f"a name of at most {room} characters")
    if not _DNS_LABEL.fullmatch(spec.runtime):
        raise bad_value("--runtime", spec.runtime, "is not a training runtime's name", "e.g. torch-distributed")


def _check_lsf(spec: RenderSpec) -> None:
    if spec.launcher not in LSF_LAUNCHERS:
        raise bad_value("--launcher", spec.launcher, "is not an LSF launcher meshrun renders",
                        "blaunch (a plain LSF cluster), jsrun (IBM CSM, whose jobs ask for whole nodes) or mpirun "
                        "(Open MPI's)")


def script_path(spec: RenderSpec) -> str | None:
    """The script of a script command (``train.py ARGS`` run as ``meshrun launch train.py``),
    else None: a ``meshrun`` command, or one that starts with an option of meshrun launch's
    (``-m pkg.train``), names no file."""
    first = spec.command[0] if spec.command else ""
    return None if first == "meshrun" or first.startswith("-") or not first else first


def _check_skypilot(spec: RenderSpec) -> None:
    """SkyPilot's ``run`` starts in ~/sky_workdir, the upload of --workdir, or in the home
    directory without one, where no local file is: a script named by a relative path needs
    the directory it is in uploaded."""
    if spec.workdir is not None and not spec.workdir.strip():
        raise bad_value("--workdir", spec.workdir, "is empty", "the local directory to upload, e.g. --workdir src")
    script = script_path(spec)
    if spec.target == "skypilot" and spec.workdir is None and script is not None \
            and not script.startswith(("/", "~")):
        raise bad_value("command", script, "is a local script, and no --workdir brings it to the nodes",
                        "--workdir DIR, the directory it is in, which SkyPilot uploads to ~/sky_workdir where run "
                        "starts; or the script's absolute path on the nodes")


def validate(spec: RenderSpec) -> RenderSpec:
    if spec.target not in TARGETS:
        raise bad_value("target", spec.target, "unknown", f"one of {', '.join(TARGETS)}")
    _check_text(spec)
    if not 1 <= spec.nodes <= MAX_NODES:
        raise bad_value("--nodes", spec.nodes, f"must be in 1..{MAX_NODES:,} (more is past any cluster built)")
    if not 0 <= spec.gpus_per_node <= MAX_GPUS_PER_NODE:
        raise bad_value("--gpus-per-node", spec.gpus_per_node,
                        f"must be in 0..{MAX_GPUS_PER_NODE} (more is past any machine built)")
    if spec.framework not in FRAMEWORKS:
        raise bad_value("--framework", spec.framework, "unknown", f"one of {', '.join(FRAMEWORKS)}")
    if not 1 <= spec.port <= 65535:
        raise bad_value("--port", spec.port, "must be in 1..65535")
    if spec.target != "hostfile" and not spec.command:
        raise bad_value("command", "", "nothing to run",
                        "put the command after --, e.g. meshrun render slurm -- meshrun train --steps 1000")
    if spec.target == "kubernetes":
        if not _DNS_LABEL.fullmatch(spec.name):
            raise bad_value("--name", spec.name, "is not a Kubernetes name (DNS-1123 label: a-z, 0-9, '-')",
                            "e.g. llama-finetune")
        if not spec.name[0].isalpha():  # the headless Service takes the name: a DNS-1035 label
            raise bad_value("--name", spec.name, "starts with a digit: the job's Service takes its name, and a "
                            "Service name starts with a letter (DNS-1035)", f"e.g. --name job-{spec.name}")
        if not spec.image:
            raise bad_value("--image", None, "Kubernetes runs containers: an image is required",
                            "e.g. --image ghcr.io/you/train:latest (with meshrun installed)")
    if spec.target == "saturn" and not spec.image:
        raise bad_value("--image", None, "a Saturn Cloud job needs an image",
                        "e.g. --image saturncloud/saturn-python-pytorch:2024.08.01")
    _check_kubernetes(spec)
    check_volume(spec.target, spec.volume)
    _check_lsf(spec)
    if spec.target == "lsf" and spec.image:
        raise bad_value("--image", spec.image, "an LSF job runs on the nodes' own software, in no container",
                        "drop it, or give --setup the command that makes meshrun available")
    if spec.requeue and spec.target != "slurm":
        raise bad_value("--requeue", True, f"is for Slurm jobs, not {spec.target}",
                        "drop it: run the same command again and meshrun train resumes from its newest snapshot")
    if spec.signal_before is not None:
        if not spec.requeue:
            raise bad_value("--signal-before", spec.signal_before, "has no effect without --requeue", "add --requeue")
        if not 1 <= spec.signal_before <= SLURM_MAX_SIGNAL_S:
            raise bad_value("--signal-before", spec.signal_before, f"must be between 1 and {SLURM_MAX_SIGNAL_S} "
                            "seconds (sbatch's --signal takes no more)",
                            f"e.g. {SIGNAL_BEFORE_S}: time for a step and a snapshot before the time limit")
    if spec.requeue and spec.time is not None and spec.target == "slurm":
        limit, lead = slurm_seconds(spec.time), spec.signal_before or SIGNAL_BEFORE_S
        if limit is not None and lead >= limit:
            raise bad_value("--time", spec.time, f"is {limit} s, no longer than the {lead} s before it that Slurm "
                            "warns the job to snapshot (--signal-before): the warning would come at the start",
                            f"a --time of more than {lead} s, or a smaller --signal-before")
    if spec.max_restarts and spec.target != "slurm":
        raise bad_value("--max-restarts", spec.max_restarts, f"is for Slurm jobs, not {spec.target}",
                        "meshrun train --max-restarts N restarts the job on any platform")
    if spec.max_restarts < 0:
        raise bad_value("--max-restarts", spec.max_restarts, "must be 0 or more", "e.g. --max-restarts 2")
    if spec.target == "hostfile" and not spec.hosts:
        raise bad_value("--hosts", "", "a hostfile needs the node addresses", "e.g. --hosts 10.0.0.1,10.0.0.2")
    _check_syntax(spec)
    _check_used(spec)
    _check_skypilot(spec)
    return spec


# The options a target's spec uses, by the field that holds them: set for another target, one
# would be dropped without a word (a --setup under Kubernetes, a --port under LSF)
USED_BY = {"setup": ("--setup", ("slurm", "lsf", "skypilot", "saturn"),
                     "put it in the image, or run it in the command: -- sh -c 'SETUP && meshrun ...'"),
           "cpus_per_task": ("--cpus-per-task", ("slurm",), "drop it"),
           "namespace": ("--namespace", ("kubernetes",), "drop it"),
           "port": ("--port", ("kubernetes", "saturn"), "drop it: the platform gives the port there"),
           "accelerator": ("--accelerator", ("skypilot",), "drop it: --gpus-per-node sets the GPUs"),
           "partition": ("--partition", ("slurm", "lsf"), "drop it"),
           "time": ("--time", ("slurm", "lsf"), "drop it"),
           "launcher": ("--launcher", ("lsf",), "drop it"),
           "workdir": ("--workdir", ("skypilot",), "drop it")}


def _check_used(spec: RenderSpec) -> None:
    """Every option given is one the target's spec uses, or refused (USED_BY)."""
    defaults = {f.name: f.default for f in fields(RenderSpec)}
    for name, (flag, targets, hint) in USED_BY.items():
        value = getattr(spec, name)
        if value != defaults[name] and spec.target not in targets:
            raise bad_value(flag, value, f"is not used by {spec.target} specs (only {', '.join(targets)}): it would "
                            "be dropped", hint)
