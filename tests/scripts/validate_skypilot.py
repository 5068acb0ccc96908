"""Validate a SkyPilot task YAML (stdin) against SkyPilot's own task schema. Run with a
Python that has skypilot installed (its click pin conflicts with huggingface-hub's, so CI
keeps it in a separate venv: MESHRUN_SKYPILOT_PYTHON)."""
import sys

import jsonschema
import yaml
from sky.utils import schemas

task = yaml.safe_load(sys.stdin)
jsonschema.validate(task, schemas.get_task_schema())
print("VALID")
