"""Kubernetes: an Indexed Job with a headless Service (peers resolve as NAME-i.NAME), or a
Kubeflow PyTorchJob with --pytorchjob.

Indexed Job: Kubernetes gives pod i the completion index i and, with ``subdomain`` set to
the Service's name, the DNS name NAME-i.NAME. The env below is what meshrun's generic
platform reads (NNODES, NODE_RANK from the completion index, MASTER_ADDR = pod 0,
MASTER_PORT, and every host for TensorFlow/JAX through MESHRUN_HOSTS). PyTorchJob: the
training operator sets PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, MASTER_ADDR and
MASTER_PORT, which meshrun's kubeflow platform reads. Either way the container's command is
meshrun's argv itself (exec form, no shell).
"""

from __future__ import annotations

from typing import Any

import yaml

from .spec import RenderSpec

INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _exec_form(argv: tuple[str, ...]) -> list[str]:
    """argv for a container's ``command``: no shell runs it, and Kubernetes' own expansion
    of ``$(VAR)`` in command and args is escaped (``$$`` is a literal ``$``), so the
    container gets exactly these arguments."""
    return [arg.replace("$", "$$") for arg in argv]


def _container(spec: RenderSpec, name: str) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": spec.image, "command": _exec_form(spec.node_command()),
               "ports": [{"containerPort": spec.port, "name": "rdzv"}],
               "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}
    if spec.gpus_per_node:
        c["resources"] = {"limits": {"nvidia.com/gpu": str(spec.gpus_per_node)}}  # a quantity: a string
    return c


def _pod_spec(spec: RenderSpec, name: str, restart: str) -> dict[str, Any]:
    # NCCL and DataLoader workers need more shared memory than a container's 64 MB default.
    return {"restartPolicy": restart, "containers": [_container(spec, name)],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}


def _meta(spec: RenderSpec) -> dict[str, Any]:
    return {"name": spec.name, **({"namespace": spec.namespace} if spec.namespace else {})}


def indexed_job(spec: RenderSpec) -> list[dict[str, Any]]:
    hosts = ",".join(f"{spec.name}-{i}.{spec.name}" for i in range(spec.nodes))
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec),
               "spec": {"clusterIP": "None", "selector": {"job-name": spec.name},
                        "ports": [{"name": "rdzv", "port": spec.port}]}}
    pod = _pod_spec(spec, "trainer", "Never")
    pod["subdomain"] = spec.name
    pod["containers"][0]["env"] = [
        {"name": "NNODES", "value": str(spec.nodes)},
        {"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": INDEX}}},
        {"name": "MASTER_ADDR", "value": f"{spec.name}-0.{spec.name}"},
        {"name": "MASTER_PORT", "value": str(spec.port)},
        {"name": "MESHRUN_HOSTS", "value": hosts},
    ]
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(spec),
           "spec": {"completions": spec.nodes, "parallelism": spec.nodes, "completionMode": "Indexed",
                    "backoffLimit": 0,
                    "template": {"metadata": {"labels": {"job-name": spec.name}}, "spec": pod}}}
    return [service, job]


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


def render(spec: RenderSpec) -> str:
    docs = pytorchjob(spec) if spec.pytorchjob else indexed_job(spec)
    head = "# Rendered by `meshrun render kubernetes`: kubectl apply -f this.yaml\n"
    if any("$" in arg for arg in spec.node_command()):
        head += "# ($$ in the command is Kubernetes' escape for a literal $: the container gets $)\n"
    body: str = yaml.safe_dump_all(docs, sort_keys=False)
    return head + body
