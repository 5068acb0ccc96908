"""meshrun.run: a function on N local processes with the process group ready; meshrun.detect."""

import pytest
from helpers import require

import meshrun
from meshrun.api import RankError

pytestmark = pytest.mark.framework


def _allreduce(scale):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)]) * scale
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever if run() did not stop it
    return "unreachable"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_run_returns_rank0_result(method):
    require("torch")
    assert meshrun.run(_allreduce, 2.0, nproc=2, start_method=method, timeout_s=120) == (0, 2, 6.0)


def test_run_accepts_a_closure_like_a_notebook_function():
    require("torch")
    import torch.distributed as dist

    offset = 40
    assert meshrun.run(lambda: dist.get_world_size() + offset, nproc=3, timeout_s=120) == 43


def test_run_raises_the_failing_rank_with_traceback():
    require("torch")
    with pytest.raises(RankError) as err:
        meshrun.run(_fail_on_rank_one, nproc=2, timeout_s=120)
    assert err.value.rank == 1
    assert "ValueError: boom on rank one" in str(err.value)
    assert "_fail_on_rank_one" in str(err.value)  # the rank's own traceback


def test_a_function_spawned_ranks_cannot_import_is_refused_in_one_line():
    require("torch")
    with pytest.raises(meshrun.MeshrunError, match=r"^fn=.*lambda.*'spawn' cannot import \(hint: define it at the top"):
        meshrun.run(lambda: 1, nproc=1, start_method="spawn")


def test_a_function_typed_into_an_interactive_session_is_not_spawned():
    """``python -c`` (as a notebook kernel) has a ``__main__`` no fresh interpreter can import."""
    require("torch")
    import subprocess
    import sys

    from helpers import clean_env

    code = ("import meshrun\ndef f():\n    return 1\ntry:\n    meshrun.run(f, nproc=1, start_method='spawn')\n"
            "except meshrun.MeshrunError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=clean_env())
    assert out.stdout.startswith("fn='f': is defined in an interactive session, which ranks started by 'spawn'"), (
        out.stdout + out.stderr[-2000:])


def test_run_rejects_bad_nproc():
    require("torch")
    with pytest.raises(meshrun.MeshrunError, match="nproc=0"):
        meshrun.run(_allreduce, 1.0, nproc=0)


def test_detect_matches_cli_view():
    t = meshrun.detect({"SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2", "SKYPILOT_NUM_NODES": "2",
                        "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_GPUS_PER_NODE": "8"})
    assert (t.platform, t.world_size, t.master_addr) == ("skypilot", 16, "10.0.0.1")


def test_integration_helpers_outside_a_launcher():
    from meshrun.integrations.jax import jax_arguments
    from meshrun.integrations.tensorflow import tf_config

    saturn = {"SATURN_JOB_SCALE": "3", "SATURN_JOB_RANK": "2", "SATURN_JOB_LEADER": "r-0.s.n.svc.cluster.local",
              "SATURN_JOB_RUN": "r", "SATURN_INTERNAL_SUBDOMAIN": "s", "SATURN_NAMESPACE": "n"}
    # The Saturn Cloud document's hand-written snippets, computed: one process per pod.
    assert jax_arguments(saturn) == {"coordinator_address": "r-0.s.n.svc.cluster.local:29500",
                                     "num_processes": 3, "process_id": 2}
    cfg = tf_config(saturn, port=5000)
    assert cfg == {"cluster": {"worker": [f"r-{i}.s.n.svc.cluster.local:5000" for i in range(3)]},
                   "task": {"type": "worker", "index": 2}}


def test_fork_after_the_parent_used_cpu_threads_does_not_hang():
    """Forked ranks inherit OpenMP's pool state without its threads; they must not wait on it."""
    require("torch")
    import subprocess
    import sys

    from helpers import clean_env, lines, script

    out = subprocess.run([sys.executable, script("fork_after_parallel.py")], capture_output=True, text=True,
                         timeout=120, env=clean_env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert lines(out.stdout, "FORKRUN") == [{"result": "1024"}]


def test_fork_after_the_parent_compiled_does_not_hang(tmp_path):
    """torch resets Inductor's compile process pool in a forked child but not its thread pool:
    a rank compiling after the parent did (each with a cold cache) waited forever on threads
    that were not forked. meshrun gives the child a fresh pool. After a compiled backward pass,
    which starts autograd's device threads on torch 2.15, a forked rank refuses every backward:
    ``auto`` spawns the ranks of a function a fresh interpreter can import."""
    require("torch")
    import subprocess
    import sys

    from helpers import clean_env, lines, script

    out = subprocess.run([sys.executable, script("fork_after_compile.py")], capture_output=True, text=True,
                         timeout=300, env=clean_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")))
    assert out.returncode == 0, out.stderr[-2000:]
    assert lines(out.stdout, "FORKRUN") == [{"result": "64"}]
    # After a compiled backward pass: torch 2.15 has started autograd's device threads (torch 2.7
    # and 2.13 have not) and the ranks are spawned; either way both ranks ran their backward.
    [after] = lines(out.stdout, "AUTOGRAD")
    assert after["result"] == "12", out.stdout
