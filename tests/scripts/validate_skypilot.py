"""Validate SkyPilot task YAMLs (stdin, one or more documents) as SkyPilot reads them: its task
schema, then sky.Task.from_yaml_config and the checks `sky launch` makes before it provisions
anything: the task's name and run, the workdir (a directory here, relative to the current one),
the file mounts, and each volume's mount path and name (SkyPilot's rule on Kubernetes, its
strictest). Resources are not checked past the schema: their check reads SkyPilot's catalog
from the network. Prints one line per document: VALID, or INVALID: the reason.

Run with a Python that has skypilot installed (its click pin conflicts with huggingface-hub's,
so CI keeps it in a separate venv: MESHRUN_SKYPILOT_PYTHON)."""
import sys

import jsonschema
import sky
import yaml
from sky.utils import schemas


def check(config: dict) -> None:
    jsonschema.validate(config, schemas.get_task_schema())
    task = sky.Task.from_yaml_config(config)
    task.validate_name()
    task.validate_run()
    task.expand_and_validate_workdir()
    task.expand_and_validate_file_mounts()
    for path, volume in task.volumes.items():
        task._validate_mount_path(path, "volumes")
        task._validate_mount_dest_is_absolute(path, "volumes")
        valid, reason = sky.clouds.Kubernetes.is_volume_name_valid(volume)
        if not valid:
            raise ValueError(reason)


for doc in yaml.safe_load_all(sys.stdin):
    try:
        check(doc)
    except Exception as exc:  # every way SkyPilot refuses a task
        print("INVALID:", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    else:
        print("VALID")
