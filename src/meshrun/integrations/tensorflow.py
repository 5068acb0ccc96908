"""``meshrun.tf_config()``: TF_CONFIG for MultiWorkerMirroredStrategy, built for you."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any


def tf_config(env: Mapping[str, str] | None = None, port: int | None = None,
              set_env: bool = True) -> dict[str, Any]:
    """Return (and by default export) TF_CONFIG for this worker; worker 0 is the chief.

    Under ``meshrun launch -f tensorflow`` TF_CONFIG is already set and is returned as is.
    Started another way (``python train.py`` on every Saturn Cloud or SkyPilot node, one
    worker per node), it is built from the detected topology, as the Saturn Cloud document's
    snippet does by hand (worker ports start at the master port, 29500 by default). Call it before
    constructing the strategy: TensorFlow reads TF_CONFIG then.
    """
    from ..api import detect
    from ..launch.tensorflow import tf_config_json, worker_addresses

    environ = os.environ if env is None else env
    if environ.get("TF_CONFIG"):
        given: dict[str, Any] = json.loads(environ["TF_CONFIG"])  # TensorFlow reads it as a JSON object
        return given
    topo = detect(dict(environ))
    # One worker per node unless the platform itself started one process per device.
    per_node = topo.nproc_per_node if topo.is_worker else 1
    topo = topo.replace(nproc_per_node=per_node, master_port=port or topo.master_port)
    index = topo.node_rank * per_node + (topo.local_rank or 0)
    text = tf_config_json(worker_addresses(topo), index)
    if set_env and env is None:
        os.environ["TF_CONFIG"] = text
    built: dict[str, Any] = json.loads(text)  # tf_config_json's object
    return built

