"""Run the real CLI in a subprocess, with a clean environment we control."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples")
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")  # fixtures: tests/data/README.md

# Variables of the machine running the tests that would change detection.
_CLUSTER_PREFIXES = ("SLURM_", "SATURN_", "SKYPILOT_", "PET_", "OMPI_", "SM_", "TORCHELASTIC_", "MESHRUN_",
                     "TF_CONFIG", "JAX_", "LSB_", "JSM_", "KUBERNETES_")
_CLUSTER_NAMES = {"MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                  "LOCAL_WORLD_SIZE", "GROUP_RANK", "NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES"}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_CLUSTER_PREFIXES) and k not in _CLUSTER_NAMES}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


FAULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")


def with_faults(env: dict[str, str], **faults: float) -> dict[str, str]:
    """``env`` for a job whose Python processes inject ``faults`` (tests/faults/sitecustomize.py)."""
    path = os.pathsep.join(p for p in (FAULTS_DIR, env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, "TEST_FAULTS": ",".join(f"{k}={v}" for k, v in faults.items())}


def meshrun(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
            cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshrun", *args], env=env if env is not None else clean_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def meshrun_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CLI's ``main`` run in this process, its output captured, as ``meshrun`` returns it:
    for a command that starts no process (``plan``), where a new interpreter would only import
    torch again (4-5 s of CPU a call on 2 cores)."""
    import contextlib
    import io

    from meshrun.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args), env if env is not None else clean_env())
        except SystemExit as exc:  # (argparse's --help and --version exit once printed)
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["meshrun", *args], code, out.getvalue(), err.getvalue())


def started_by_shell(text: str, processes: list[dict], tmp_path) -> tuple[list[str], list[str]]:
    """What the shell text of a dry run starts, against what its JSON says (``processes``: each
    one's argv and env): the text run by bash with each program replaced by a probe that records
    its arguments and variables. Both as sorted lists of canonical JSON (a JSON value compared
    as what it parses to: the text lays it over lines)."""
    import json
    import shlex

    probe = tmp_path / "probe.py"
    probe.write_text("import json, os, sys, uuid\n"
                     f"path = os.path.join({str(tmp_path)!r}, uuid.uuid4().hex + '.started')\n"
                     "json.dump({'argv': sys.argv[1:], 'env': dict(os.environ)}, open(path, 'w'))\n")

    def canon(value: str) -> object:
        return json.loads(value) if value.startswith("{") else value

    script = text
    for program in {p["argv"][0] for p in processes}:
        script = script.replace(shlex.quote(program) + " ", f"{shlex.quote(sys.executable)} {shlex.quote(str(probe))} ")
    res = subprocess.run(["bash", "-c", script], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    started = []
    for name in sorted(os.listdir(tmp_path)):
        if name.endswith(".started"):
            with open(tmp_path / name) as f:
                started.append(json.load(f))
    names = {k for p in processes for k in p["env"]}
    got = sorted(json.dumps([s["argv"], {k: canon(v) for k, v in s["env"].items() if k in names}], sort_keys=True)
                 for s in started)
    want = sorted(json.dumps([p["argv"][1:], {k: canon(v) for k, v in p["env"].items()}], sort_keys=True)
                  for p in processes)
    return got, want


def marked_pids(mark: str, tag: str) -> list[int]:
    """Live processes (zombies left out) whose environment holds ``mark=tag``: a test's job,
    found by a variable it set, whatever sessions its processes moved into."""
    entry = f"{mark}={tag}".encode()
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X") and entry in env:
            pids.append(int(name))
    return pids


def wait_for(condition, timeout: float, every: float = 0.1) -> bool:
    """Poll ``condition`` every ``every`` seconds until it holds or ``timeout`` passes;
    returns whether it held (checked once more at the end)."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(every)
    return condition()


def script(name: str) -> str:
    return os.path.join(SCRIPTS, name)


def example(name: str) -> str:
    return os.path.join(EXAMPLES, name)


def bench_module(name: str):
    """A script of bench/ imported as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def require(module: str) -> None:
    """Skip when a framework is not installed, except under MESHRUN_TEST_STRICT=1 (CI),
    where a missing framework is a failure: CI must run every real launch."""
    import importlib.util

    import pytest

    if importlib.util.find_spec(module) is None:
        if os.environ.get("MESHRUN_TEST_STRICT") == "1":
            pytest.fail(f"{module} is not installed but MESHRUN_TEST_STRICT=1")
        pytest.skip(f"{module} not installed")


def lines(output: str, tag: str) -> list[dict[str, str]]:
    """Parse 'TAG key=value key=value' lines printed by the scripts in tests/scripts."""
    rows = []
    for line in output.splitlines():
        if line.startswith(tag + " "):
            rows.append(dict(item.split("=", 1) for item in line.split()[1:]))
    return rows
