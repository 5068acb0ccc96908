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
from collections.abc import Mapping
from urllib.parse import urlsplit

from ..errors import MeshrunError, bad_value

# Each tracker: the module it needs and the extra that installs it.
TRACKERS = {"tensorboard": ("tensorboard", "torch"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
DEFAULT = "tensorboard"
CONNECT_TIMEOUT_S = 5.0  # a server whose answer takes longer is reported, not waited on
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
    """The server at ``url`` sends an HTTP answer (any status) within CONNECT_TIMEOUT_S in all:
    a port that refuses, a host that drops the connection and a listener that accepts and never
    replies are each one line here, not a client library's retries at the first step. Behind a
    proxy the clients reach the server through it: not checked here."""
    if any(env.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return
    parts = urlsplit(url)
    if not parts.hostname:
        raise bad_value(where, url, "names no host", hint)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise bad_value(where, url, "names a port that is not a number in 0..65535", hint) from None
    problem = _http_answer(parts.scheme, parts.hostname, port, parts.path or "/", CONNECT_TIMEOUT_S)
    if problem:
        raise bad_value(where, url, problem, hint)


def _http_answer(scheme: str, host: str, port: int, path: str, seconds: float) -> str:
    """What is wrong with the server's answer to one GET of ``path`` within ``seconds`` ("" when
    it sent a status line). The certificate is not checked: whether the server answers is the
    question here; the tracker's client checks it as it always does."""
    import http.client
    import ssl
    import time

    deadline = time.monotonic() + seconds
    if scheme == "https":
        unchecked = ssl.create_default_context()
        unchecked.check_hostname, unchecked.verify_mode = False, ssl.CERT_NONE
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(host, port, timeout=seconds,
                                                                       context=unchecked)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=seconds)
    try:
        conn.connect()
        if conn.sock is not None:  # connecting used part of the time: the answer gets the rest
            conn.sock.settimeout(max(deadline - time.monotonic(), 0.01))
        conn.request("GET", path, headers={"User-Agent": "meshrun-preflight", "Connection": "close"})
        conn.getresponse().close()
        return ""
    except TimeoutError:
        connected = conn.sock is not None
        return (f"the server accepts connections but sends no answer within {seconds:g} s" if connected
                else f"the server does not answer within {seconds:g} s")
    except http.client.HTTPException as e:
        return f"the server does not answer in HTTP ({type(e).__name__})"
    except OSError as e:
        return f"the server does not answer ({e.strerror or type(e).__name__})"
    finally:
        conn.close()


def _netrc_has(host: str) -> bool:
    path = os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
