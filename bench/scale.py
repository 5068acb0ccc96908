"""Launch at scale on one machine: N hosts, one process per host, the generic platform's
variables (MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK) on every host. `meshrun launch` and
plain torchrun with the flags meshrun passes (the static rendezvous) run the same script,
alternating, N = 2 ... 24; and snapshot resume on 2, 4, 8 ranks of one host.

Hosts are network namespaces (--hosts netns, the default: a bridge and a veth pair each,
addresses 10.231.S.0/24 created here; needs root) or launcher processes on this machine's
loopback (--hosts loopback: no root, for a many-core machine where the N hosts' processes do
not share a few cores).

    sudo .venv/bin/python bench/scale.py --nodes 2,4,8,16,24 --repeats 5 --resume-ranks 2,4,8
    python bench/scale.py --hosts loopback --nodes 2,4,8,16,24 --repeats 5 --resume-ranks ''

Per run, from the moment every host's command is started:
  wall_s          until the last process exited
  init_s          until the last rank finished init_process_group and one all-reduce
  launcher_s      until the last host's torchrun started (from /proc: the worker's parent, in
                  clock ticks after the first host's command started)
  launcher_spread_s  the last host's torchrun start minus the first's
  cpu_s_per_host  CPU seconds of every process of the run (launchers, workers, meshrun and its
                  watchdog), over N: what a host spends, whatever the cores it shares
Resume: `meshrun train --strategy fsdp-full` saves a sharded snapshot on R ranks, then the
same command resumes it; its resume line gives the fastest and the slowest rank's read time,
CPU time and megabytes read (each a (fastest, slowest) pair in the RESUME row).

Every host shares this machine's cores: N processes importing torch on 2 cores take seconds
each, so the wall times grow with N for both launchers; the comparison is the difference.
Needs root (ip netns). Everything made is torn down, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import netns  # noqa: E402 - tests/netns.py (the multi-host tests' namespaces) imports once its folder is on sys.path

PORT = 29400
# meshrun train's resume line: wall seconds, CPU seconds and MB read, fastest and slowest rank
READ = re.compile(r"read in ([0-9.]+)-([0-9.]+) s a rank \(([0-9.]+)-([0-9.]+) s of CPU, ([0-9.]+)-([0-9.]+) MB\)")
WORKER = r'''
import json, os, sys, time
import torch
import torch.distributed as dist


def started(pid):
    """When process ``pid`` started: clock ticks after boot, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[19])


dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
ready = time.time()
sys.stdout.write("SCALE " + json.dumps({"rank": dist.get_rank(), "sum": t.item(), "ready": ready,
                                        "launcher": started(os.getppid())}) + "\n")
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
'''


class LoopbackHost:
    """A "host" that is a launcher process on this machine's loopback."""

    addr, ifname = "127.0.0.1", "lo"

    def command(self, argv: list[str], env: dict[str, str]) -> list[str]:
        return ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]


def env_for(i: int, hosts: list) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH")}
    # GLOO_SOCKET_IFNAME as a user of plain torchrun must set it (gloo would otherwise take the
    # address the host name resolves to, outside the namespace); meshrun keeps a user's value.
    return {**keep, "MASTER_ADDR": hosts[0].addr, "MASTER_PORT": str(PORT), "NNODES": str(len(hosts)),
            "NODE_RANK": str(i), "GLOO_SOCKET_IFNAME": hosts[i].ifname, "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}


def console_script(name: str) -> list[str]:
    """A console script beside this interpreter (as a user runs it), else ``python -m``."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(beside, os.X_OK):
        return [beside]
    return [sys.executable, "-m", {"meshrun": "meshrun", "torchrun": "torch.distributed.run"}[name]]


def argv_for(tool: str, i: int, hosts: list, script: str) -> list[str]:
    if tool == "meshrun":
        return [*console_script("meshrun"), "launch", "--nproc", "1", script]
    return [*console_script("torchrun"), f"--nnodes={len(hosts)}", f"--node_rank={i}", "--nproc_per_node=1",
            f"--master_addr={hosts[0].addr}", f"--master_port={PORT}", script]


def started_ticks(pid: int) -> int:
    """When process ``pid`` started: clock ticks after boot, from /proc (as the workers read
    their launcher's), so launcher times are differences of one clock."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[19])


def one_launch(tool: str, hosts: list, script: str, timeout: float) -> dict[str, float]:
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    procs = [subprocess.Popen(h.command(argv_for(tool, i, hosts, script), env_for(i, hosts)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, h in enumerate(hosts)]
    first_tick = started_ticks(procs[0].pid)
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if isinstance(hosts[0], netns.Host):
            netns.kill_all(hosts)
    wall = time.time() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    bad = [(p.returncode, err[-600:]) for p, (_, err) in zip(procs, outs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"{tool} on {len(hosts)} hosts failed: {bad[0]}")
    rows = [json.loads(line[6:]) for out, _ in outs for line in out.splitlines() if line.startswith("SCALE ")]
    n = len(hosts)
    if len(rows) != n or any(r["sum"] != n for r in rows):
        raise RuntimeError(f"{tool} on {n} hosts: {len(rows)} ranks reported, sums {[r['sum'] for r in rows]}")
    tick = os.sysconf("SC_CLK_TCK")
    starts = [(r["launcher"] - first_tick) / tick for r in rows]
    return {"wall_s": wall, "init_s": max(r["ready"] for r in rows) - t0,
            "launcher_s": max(starts), "launcher_spread_s": max(starts) - min(starts), "cpu_s_per_host": cpu / n}


def launch_scale(counts: list[int], repeats: int, subnet: int, timeout: float, loopback: bool) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "scale_worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        os.chmod(tmp, 0o755)
        for n in counts:
            tag = f"b{os.getpid() % 1000}"
            hosts = [LoopbackHost() for _ in range(n)] if loopback else netns.create_hosts(tag, subnet, n, {})
            try:
                if n == counts[0]:  # untimed: the first runs read torch from disk, the rest from memory
                    for tool in ("meshrun", "torchrun"):
                        one_launch(tool, hosts, script, timeout)
                runs: dict[str, list[dict[str, float]]] = {"meshrun": [], "torchrun": []}
                for r in range(repeats):
                    order = ("meshrun", "torchrun") if r % 2 == 0 else ("torchrun", "meshrun")
                    for tool in order:  # alternating, so drift on the host hits both alike
                        runs[tool].append(one_launch(tool, hosts, script, timeout))
            finally:
                if not loopback:
                    netns.destroy(hosts, f"mr{tag}sw")
            row: dict = {"nodes": n, "repeats": repeats}
            for tool, rs in runs.items():
                for key in rs[0]:
                    row[f"{tool}_{key}"] = round(statistics.median(x[key] for x in rs), 3)
            for key in ("wall_s", "cpu_s_per_host"):  # each pair ran back to back: its difference
                row[f"added_{key}"] = round(statistics.median(m[key] - t[key] for m, t in
                                                              zip(runs["meshrun"], runs["torchrun"])), 3)
            print("SCALE " + json.dumps(row), flush=True)
            results.append(row)
    return results


def resume_scale(ranks: list[int], size: str, timeout: float) -> list[dict]:
    """Per-rank seconds to load a sharded snapshot (FSDP, each rank its own shard files),
    saved and resumed on the same number of ranks."""
    results = []
    for r in ranks:
        out = tempfile.mkdtemp(prefix="meshrun-scale-resume-")
        try:
            common = [sys.executable, "-m", "meshrun", "train", "--nproc", str(r), "--strategy", "fsdp-full",
                      "--model-size", size, "--seq-len", "32", "--micro-batch", "1", "--log-every", "1",
                      "--save-every", "2", "--data", "random", "--out", out]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            first = subprocess.run([*common, "--steps", "2"], capture_output=True, text=True, env=env, timeout=timeout,
                                   check=False)
            if first.returncode != 0:
                raise RuntimeError(f"saving on {r} ranks failed: {first.stderr[-800:]}")
            again = subprocess.run([*common, "--steps", "3"], capture_output=True, text=True, timeout=timeout,
                                   env=env, check=False)
            found = READ.search(again.stdout + again.stderr)
            if again.returncode != 0 or found is None:
                raise RuntimeError(f"resuming on {r} ranks failed: {(again.stdout + again.stderr)[-800:]}")
            snap = os.path.join(out, "checkpoints", "step-00000002")
            size_b = sum(os.path.getsize(os.path.join(snap, f)) for f in os.listdir(snap))
            wall, cpu, mb = (tuple(float(found.group(i)) for i in pair) for pair in ((1, 2), (3, 4), (5, 6)))
            row = {"ranks": r, "model": size, "snapshot_mb": round(size_b / 2**20, 1), "read_s": wall,
                   "cpu_s": cpu, "read_mb": mb}
            print("RESUME " + json.dumps(row), flush=True)
            results.append(row)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="2,4,8,16,24", help="host counts, comma-separated ('' for none)")
    ap.add_argument("--hosts", choices=("netns", "loopback"), default="netns",
                    help="hosts as network namespaces (root) or as processes on the loopback")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--resume-ranks", default="2,4,8", help="rank counts for the resume part ('' for none)")
    ap.add_argument("--resume-model", default="gpt-small")
    ap.add_argument("--subnet", type=int, default=201, help="the third byte of 10.231.S.0/24")
    ap.add_argument("--timeout", type=float, default=180, help="seconds one run may take")
    args = ap.parse_args()
    # SIGTERM (a timeout's, a scheduler's) unwinds like Ctrl-C: the finally blocks tear down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.nodes:
        why = netns.available() if args.hosts == "netns" else None
        if why:
            sys.exit(f"bench/scale.py: network namespaces {why} (hint: --hosts loopback)")
        launch_scale([int(n) for n in args.nodes.split(",")], args.repeats, args.subnet, args.timeout,
                     args.hosts == "loopback")
    if args.resume_ranks:
        resume_scale([int(r) for r in args.resume_ranks.split(",")], args.resume_model, args.timeout)


if __name__ == "__main__":
    main()
