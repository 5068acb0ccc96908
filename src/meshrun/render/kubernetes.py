"""Kubernetes (``--as``): an Indexed Job with a headless Service (peers resolve as NAME-i.NAME),
a Kubeflow PyTorchJob (Training Operator v1), a Kubeflow Trainer v2 TrainJob, or a JobSet.

Indexed Job: Kubernetes gives pod i the completion index i and, with ``subdomain`` set to
the Service's name, the DNS name NAME-i.NAME. The env below is what meshrun's generic
platform reads (NNODES, NODE_RANK from the completion index, MASTER_ADDR = pod 0,
MASTER_PORT, and every host for TensorFlow/JAX through MESHRUN_HOSTS). JobSet: one replicated
job of the same Indexed Job; JobSet makes the headless Service itself (named after the JobSet)
and names pod i NAME-node-0-i, so the same variables point at NAME-node-0-0.NAME. PyTorchJob and
TrainJob: the operator sets PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE and the master's
address (MASTER_ADDR under v1, PET_MASTER_ADDR under Trainer v2's torch runtime), which meshrun's
kubeflow platform reads. Either way the container's command is meshrun's argv itself (exec form,
no shell). ``--volume CLAIM:PATH`` mounts a PersistentVolumeClaim on every pod, where a run's
``--out`` outlives the pod (volumes.py).
"""

from __future__ import annotations

from typing import Any

import yaml

from .spec import RenderSpec
from .volumes import volume_parts

INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _exec_form(argv: tuple[str, ...]) -> list[str]:
    """argv for a container's ``command``: no shell runs it, and Kubernetes' own expansion
    of ``$(VAR)`` in command and args is escaped (``$$`` is a literal ``$``), so the
    container gets exactly these arguments."""
    return [arg.replace("$", "$$") for arg in argv]


def _mounts(spec: RenderSpec) -> list[dict[str, Any]]:
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.volume:
        mounts.append({"name": "out", "mountPath": volume_parts(spec.volume)[1]})
    return mounts


def _volumes(spec: RenderSpec) -> list[dict[str, Any]]:
    # NCCL and DataLoader workers need more shared memory than a container's 64 MB default.
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if spec.volume:
        volumes.append({"name": "out", "persistentVolumeClaim": {"claimName": volume_parts(spec.volume)[0]}})
    return volumes


def _gpus(spec: RenderSpec) -> dict[str, Any]:
    return {"limits": {"nvidia.com/gpu": str(spec.gpus_per_node)}}  # a quantity: a string


def _container(spec: RenderSpec, name: str) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": spec.image, "command": _exec_form(spec.node_command()),
                         "ports": [{"containerPort": spec.port, "name": "rdzv"}], "volumeMounts": _mounts(spec)}
    if spec.gpus_per_node:
        c["resources"] = _gpus(spec)
    return c


def _pod_spec(spec: RenderSpec, name: str, restart: str) -> dict[str, Any]:
    return {"restartPolicy": restart, "containers": [_container(spec, name)], "volumes": _volumes(spec)}


def _node_env(spec: RenderSpec, pod: str) -> list[dict[str, Any]]:
    """What meshrun's generic platform reads on pod i of an Indexed Job whose pods resolve as
    ``pod.format(i)``."""
    return [
        {"name": "NNODES", "value": str(spec.nodes)},
        {"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": INDEX}}},
        {"name": "MASTER_ADDR", "value": pod.format(0)},
        {"name": "MASTER_PORT", "value": str(spec.port)},
        {"name": "MESHRUN_HOSTS", "value": ",".join(pod.format(i) for i in range(spec.nodes))},
    ]


def _indexed(spec: RenderSpec, pod: dict[str, Any]) -> dict[str, Any]:
    return {"completions": spec.nodes, "parallelism": spec.nodes, "completionMode": "Indexed", "backoffLimit": 0,
            "template": pod}


def _meta(spec: RenderSpec) -> dict[str, Any]:
    return {"name": spec.name, **({"namespace": spec.namespace} if spec.namespace else {})}


def indexed_job(spec: RenderSpec) -> list[dict[str, Any]]:
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec),
               "spec": {"clusterIP": "None", "selector": {"job-name": spec.name},
                        "ports": [{"name": "rdzv", "port": spec.port}]}}
    pod = _pod_spec(spec, "trainer", "Never")
    pod["subdomain"] = spec.name
    pod["containers"][0]["env"] = _node_env(spec, f"{spec.name}-{{}}.{spec.name}")
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(spec),
           "spec": _indexed(spec, {"metadata": {"labels": {"job-name": spec.name}}, "spec": pod})}
    return [service, job]


def jobset(spec: RenderSpec) -> list[dict[str, Any]]:
    """One replicated job ("node") of one Indexed Job of ``nodes`` pods; JobSet's own headless
    Service resolves pod i as NAME-node-0-i.NAME."""
    pod = _pod_spec(spec, "trainer", "Never")
    pod["containers"][0]["env"] = _node_env(spec, f"{spec.name}-node-0-{{}}.{spec.name}")
    return [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _meta(spec),
             "spec": {"network": {"enableDNSHostnames": True}, "failurePolicy": {"maxRestarts": 0},
                      "replicatedJobs": [{"name": "node", "replicas": 1,
                                          "template": {"spec": _indexed(spec, {"spec": pod})}}]}}]


def trainjob(spec: RenderSpec) -> list[dict[str, Any]]:
    """A TrainJob on the ``spec.runtime`` training runtime (torch-distributed: its torch plugin
    sets PET_* on each of ``nodes`` pods); shared memory and the volume are patched into the
    runtime's "node" job, the container Trainer v2 names "node"."""
    trainer: dict[str, Any] = {"image": spec.image, "command": _exec_form(spec.node_command()),
                               "numNodes": spec.nodes}
    if spec.gpus_per_node:
        trainer["resourcesPerNode"] = _gpus(spec)
    pod = {"volumes": _volumes(spec), "containers": [{"name": "node", "volumeMounts": _mounts(spec)}]}
    patch = {"manager": "meshrun", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}}}}
    return [{"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": _meta(spec),
             "spec": {"runtimeRef": {"name": spec.runtime}, "trainer": trainer, "runtimePatches": [patch]}}]


def pytorchjob(spec: RenderSpec) -> list[dict[str, Any]]:
    def replica(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"spec": _pod_spec(spec, "pytorch", "OnFailure")}}  # the operator wants "pytorch"

    replicas = {"Master": replica(1)}
    if spec.nodes > 1:
        replicas["Worker"] = replica(spec.nodes - 1)
    return [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _meta(spec),
             "spec": {"nprocPerNode": str(spec.gpus_per_node or 1), "pytorchReplicaSpecs": replicas,
                      # keep failed pods for their logs; the operator's default cleans running ones
                      "runPolicy": {"cleanPodPolicy": "None"}}}]


KINDS = {"job": indexed_job, "pytorchjob": pytorchjob, "trainjob": trainjob, "jobset": jobset}


def render(spec: RenderSpec) -> str:
    docs = KINDS[spec.kind](spec)
    head = "# Rendered by `meshrun render kubernetes`: kubectl apply -f this.yaml\n"
    if any("$" in arg for arg in spec.node_command()):
        head += "# ($$ in the command is Kubernetes' escape for a literal $: the container gets $)\n"
    body: str = yaml.safe_dump_all(docs, sort_keys=False)
    return head + body
