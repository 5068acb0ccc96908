"""Which experiment trackers a run logs to (``--log-with``), and the checks made before any
rank starts: the package is installed, the server answers, W&B has a key. A tracker that
cannot work is one line at start, never a failure at step 1000.

The trackers read their users' own variables: ``WANDB_PROJECT``, ``WANDB_ENTITY``,
``WANDB_MODE``, ``WANDB_RUN_ID``, ``WANDB_DIR``, ``WANDB_BASE_URL``, ``WANDB_API_KEY``;
``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID``. What a run does with
them is tracking.py's (it imports the packages); this module is torch-free and imports
neither package, so the CLI checks a run before launching anything.
"""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
import socket
from collections.abc import Mapping
from urllib.parse import urlsplit

from ..errors import MeshrunError, bad_value

# Each tracker: the module it needs and the extra that installs it.
TRACKERS = {"tensorboard": ("tensorboard", "torch"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
DEFAULT = "tensorboard"
CONNECT_TIMEOUT_S = 5.0  # a server that does not answer in this long is reported, not waited on
OFFLINE_WANDB = ("offline", "dryrun", "disabled")


IDS_FILE = "trackers.json"  # in OUT: the tracker runs a resume continues, by tracker


def saved_ids(out: str | None) -> dict[str, dict[str, str]]:
    """OUT/trackers.json's run ids by tracker; {} without OUT or the file. A file that is not
    what meshrun writes (a JSON object of objects) is refused: read as empty, it would start a
    second tracker run and split the run's curves in two."""
    if not out:
        return {}
    path = os.path.join(out, IDS_FILE)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:
        raise MeshrunError(f"{path}: damaged, not the tracker run ids meshrun writes ({type(exc).__name__}) "
                           f"(hint: {DELETE_IDS})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise MeshrunError(f"{path}: damaged, not the tracker run ids meshrun writes (hint: {DELETE_IDS})")
    return data


DELETE_IDS = "delete it, and the resumed run starts new tracker runs; the earlier ones stay in their stores"


def installed(name: str) -> bool:
    return importlib.util.find_spec(TRACKERS[name][0]) is not None


def parse(value: str, where: str, given: bool = True) -> tuple[str, ...]:
    """The trackers ``value`` names: a comma list of TRACKERS' names, ``all`` (every one
    installed) or ``none``. A tracker named but not installed is an error, unless the value
    is the default (``given`` False): TensorBoard then logs where it is installed."""
    words = [w.strip().lower() for w in value.split(",") if w.strip()]
    if not words:
        raise bad_value(where, value, "names no tracker", f"a comma list of {', '.join(TRACKERS)}, or all, or none")
    if "none" in words or "all" in words:
        if len(words) > 1:
            raise bad_value(where, value, f"{'none' if 'none' in words else 'all'} stands alone",
                            f"a comma list of {', '.join(TRACKERS)}, or all, or none")
        return () if words[0] == "none" else tuple(n for n in TRACKERS if installed(n))
    unknown = [w for w in words if w not in TRACKERS]
    if unknown:
        raise bad_value(where, value, f"unknown tracker {unknown[0]!r}", f"choose from {', '.join(TRACKERS)}, "
                        "all, none")
    names = tuple(dict.fromkeys(words))  # in the order given, each once
    if not given:
        return tuple(n for n in names if installed(n))
    for name in names:
        if not installed(name):
            module, extra = TRACKERS[name]
            raise bad_value(where, value, f"{module} is not installed here",
                            f"pip install 'meshrun[{extra}]', or drop {name}")
    return names


def preflight(names: tuple[str, ...], env: Mapping[str, str]) -> None:
    """Before the ranks start: the servers the trackers will talk to answer, and W&B online has
    a key. Offline modes and local stores need nothing."""
    if "mlflow" in names:
        uri = env.get("MLFLOW_TRACKING_URI", "")
        if urlsplit(uri).scheme in ("http", "https"):
            _reachable(uri, "env MLFLOW_TRACKING_URI", "start the tracking server, or unset it for a local store",
                       env)
    if "wandb" in names and env.get("WANDB_MODE", "").lower() not in OFFLINE_WANDB:
        base = env.get("WANDB_BASE_URL") or "https://api.wandb.ai"
        if not (env.get("WANDB_API_KEY") or _netrc_has(urlsplit(base).hostname or "")):
            raise MeshrunError("--log-with wandb: no W&B API key (env WANDB_API_KEY, or `wandb login`'s ~/.netrc) "
                               "for " + base + " (hint: wandb login, or WANDB_MODE=offline to sync later with "
                               "wandb sync)")
        _reachable(base, "env WANDB_BASE_URL" if env.get("WANDB_BASE_URL") else "W&B's server",
                   "WANDB_MODE=offline to log now and sync later (wandb sync)", env)


def _reachable(url: str, where: str, hint: str, env: Mapping[str, str]) -> None:
    """A TCP connection to the URL's host and port opens within CONNECT_TIMEOUT_S (behind a
    proxy the clients reach the server through it: not checked here)."""
    if any(env.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not parts.hostname:
        raise bad_value(where, url, "names no host", hint)
    try:
        with socket.create_connection((parts.hostname, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise bad_value(where, url, f"the server does not answer ({e.strerror or e})", hint) from None


def _netrc_has(host: str) -> bool:
    path = os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
