"""meshrun doctor and meshrun bench on this machine (no GPU): real checks, real gloo jobs."""

from __future__ import annotations

import json
import socket

import pytest
from helpers import clean_env, meshrun, require

from meshrun.doctor.checks import check_gpu_health, check_versions_across
from meshrun.doctor.facts import Facts, parse_gpu_query


def doctor(*args, env=None):
    out = meshrun("doctor", "--json", *args, env=env or clean_env(CUDA_VISIBLE_DEVICES=""), timeout=120)
    return out.returncode, json.loads(out.stdout) if out.stdout.strip() else None, out.stderr


def by_check(report, check):
    return [f for f in report["findings"] if f["check"] == check]


def test_doctor_here_is_sensible():
    code, report, err = doctor()
    assert code == 0, err
    assert by_check(report, "gpus")[0]["status"] == "warn"  # no GPU: gloo, said so
    assert by_check(report, "versions")[0]["status"] == "ok"
    assert by_check(report, "disk")[0]["status"] in ("ok", "warn")
    assert report["status"] == "warn"


def test_nproc_above_gpus_fails():
    code, report, _ = doctor("--nproc", "2", env=clean_env(CUDA_VISIBLE_DEVICES="0"))
    (f,) = by_check(report, "gpus")
    assert code == 1 and f["status"] == "fail" and "2 processes per node but 1 GPU(s) visible" in f["reason"]


def test_wrong_nccl_interface_fails():
    code, report, _ = doctor(env=clean_env(CUDA_VISIBLE_DEVICES="", NCCL_SOCKET_IFNAME="eth9"))
    (f,) = by_check(report, "interface")
    assert code == 1 and f["status"] == "fail" and f["reason"].startswith("NCCL_SOCKET_IFNAME=eth9: no interface eth9")
    assert "lo" in f["fix"]


def test_master_port_in_use_fails_and_closed_port_warns():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = str(s.getsockname()[1])
        code, report, _ = doctor("--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                                 "--master-port", port)
        assert code == 1
        assert [f["status"] for f in by_check(report, "master port")] == ["fail"]
    code, report, _ = doctor("--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", port)
    (f,) = by_check(report, "master port")
    assert code == 0 and f["status"] == "warn" and "nothing listens" in f["reason"]


def test_unresolvable_master_fails():
    code, report, _ = doctor("--nnodes", "2", "--node-rank", "1", "--master-addr", "nobody.invalid")
    (f,) = by_check(report, "master address")
    assert code == 1 and f["status"] == "fail" and "does not resolve" in f["reason"]


def test_nccl_variables_get_the_seed_s_advice():
    code, report, _ = doctor(env=clean_env(CUDA_VISIBLE_DEVICES="", NCCL_DEBUG="INFO", NCCL_IB_DISABLE="0"))
    found = {f["reason"].split(":")[0]: f for f in by_check(report, "nccl env")}
    assert found["NCCL_DEBUG=INFO"]["status"] == "warn" and "production" in found["NCCL_DEBUG=INFO"]["reason"]
    assert "InfiniBand" in found["NCCL_IB_DISABLE=0"]["reason"]


def test_versions_compared_across_nodes():
    a = Facts("a", 8, torch="2.11.0", cuda="13.0", nccl="2.27.3", driver="580.1")
    b = Facts("b", 8, torch="2.11.0", cuda="12.8", nccl="2.27.3", driver="580.1")
    (f,) = check_versions_across([a, a, b])
    assert f.status == "fail" and f.reason == "cuda differs across nodes: 13.0 on node(s) 0,1; 12.8 on node(s) 2"
    assert check_versions_across([a, a])[0].status == "ok"


def test_doctor_across_ranks_under_launch():
    require("torch")
    out = meshrun("launch", "--nproc", "2", "-m", "meshrun", "doctor", "--json",
                  env=clean_env(CUDA_VISIBLE_DEVICES=""), timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)  # one report, from rank 0
    assert any(f["reason"].startswith("torch, CUDA, NCCL and driver agree on all 1 nodes") for f in report["findings"])
    assert any(f.get("node") == 0 and f["check"] == "master" for f in report["findings"])


def test_bench_comm_bandwidths_follow_the_conventions():
    require("torch")
    env = clean_env()
    env.pop("OMP_NUM_THREADS", None)  # (torchrun prints its banner only when the variable is unset)
    out = meshrun("bench", "comm", "--sizes", "64KiB,1MiB", "--min-time", "0.05", "--json", env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # torchrun's four-line banner about OMP_NUM_THREADS: meshrun sets the variable for its processes
    assert "OMP_NUM_THREADS" not in out.stderr and "*****" not in out.stderr, out.stderr
    result = json.loads(out.stdout)
    assert result["world"] == 2 and result["backend"] == "gloo"
    factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0}  # n = 2
    assert sorted({r["op"] for r in result["rows"]}) == sorted(factor)
    for r in result["rows"]:
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor[r["op"]], rel=1e-9)
        assert r["algbw_gbps"] * 1e9 * r["time_us"] * 1e-6 == pytest.approx(r["bytes"], rel=1e-6)
        assert r["time_us"] > 0


def test_bench_matmul_and_train_run():
    require("torch")
    out = meshrun("bench", "matmul", "--n", "256", "--min-time", "0.02", "--json", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout)["rows"][0]
    assert row["dtype"] == "float32" and len(row["per_rank"]) == 2 and row["tflops_min"] > 0
    out = meshrun("bench", "train", "--steps", "2", "--json", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["tokens_per_s_per_gpu"] > 0 and result["strategy"] == "ddp" and result["mfu"] is None


@pytest.mark.parametrize("args,message", [
    (["bench", "comm", "--ops", "all_to_all"], "--ops='all_to_all': unknown collective"),
    (["bench", "comm", "--sizes", "1GiB:1KiB"], "--sizes='1GiB:1KiB': min is above max"),
    (["bench", "matmul", "--n", "0"], "--n='0': must be >= 1"),
    (["bench", "train", "--model", "gpt-9t"], "--model='gpt-9t': not a GPT preset"),
    (["bench", "comm", "--min-time", "soon"], "--min-time='soon': not a number"),
])
def test_bench_bad_input_is_one_line(args, message):
    out = meshrun(*args)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_gpu_health_reads_ecc_throttling_and_a_lowered_power_limit():
    """Rows in nvidia-smi's csv,noheader format (units included; one card's limit lowered):
    uncorrected ECC errors fail, a throttled idle card and a power limit below the default
    warn (training runs at the limit: H200s at 700 W, torch 2.11,
    docs/benchmarks/throughput_4xH200_2026-11-27.md); '[N/A]' is no number."""
    rows = parse_gpu_query(
        "NVIDIA H200, 580.95.05, 0x0000000000000001, 0, 31, 700.00 W, 700.00 W\n"
        "NVIDIA H200, 580.95.05, 0x0000000000000004, 0, 35, 500.00 W, 700.00 W\n"
        "NVIDIA H200, 580.95.05, 0x0000000000000001, 2, 33, [N/A], 700.00 W\n"
        "a line nvidia-smi printed instead\n")
    assert [r["power_limit"] for r in rows] == ["700.00 W", "500.00 W", "[N/A]"] and rows[0]["driver"] == "580.95.05"
    findings = check_gpu_health(Facts("node", 3, gpu_health=tuple(rows)))
    reasons = sorted((f.status, f.reason) for f in findings)
    assert reasons == [("fail", "GPU 2: 2 uncorrected ECC errors"),
                       ("warn", "GPU 1: clock event reasons 0x0000000000000004 (throttled)"),
                       ("warn", "GPU 1: power limit 500 W, below its default 700 W")], reasons
    assert "nvidia-smi -pl 700" in next(f.fix for f in findings if "power limit" in f.reason)
    healthy = check_gpu_health(Facts("node", 1, gpu_health=tuple(rows[:1])))
    assert [(f.status, f.reason) for f in healthy] == [("ok", "1 GPU(s): no ECC errors, not throttled")]
