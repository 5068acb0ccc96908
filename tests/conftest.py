import glob
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# DeepSpeed's CPU all-reduce (its shared-memory path) creates two 66-MB files per run in
# /dev/shm and never unlinks them; a dev machine had 8.3 GB of them after a day of test runs.
DEEPSPEED_SHM = "/dev/shm/deepspeed_allreduce_buffer_*"


@pytest.fixture(autouse=True, scope="session")
def _remove_deepspeeds_shared_memory():
    before = set(glob.glob(DEEPSPEED_SHM))
    yield
    for path in set(glob.glob(DEEPSPEED_SHM)) - before:
        try:
            os.unlink(path)
        except OSError:
            pass


# .ci/run's main suite runs in pytest-xdist workers a module at a time (--dist loadscope), in
# collection order. The modules that take longest start first, so that the suite does not end
# on one long module running alone while the other worker idles (test_preempt ran alone for the
# last 13 minutes of a 44-minute run on 2 cores). Ordered by their measured durations there.
LONGEST_FIRST = ("test_train_equivalence.py", "test_plan.py", "test_cluster.py", "test_checkpoint.py",
                 "test_hf_models.py", "test_data.py", "test_train_cli.py", "test_float8.py", "test_write_safety.py",
                 "test_launch_real.py", "test_hangs.py", "test_preempt.py", "test_bad_input.py",
                 "test_job_failures.py", "test_mpi.py", "test_examples.py", "test_doctor.py", "test_plan_trace.py",
                 "test_trackers.py", "test_misuse_snapshots.py", "test_misuse_launcher.py", "test_head_loss.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(LONGEST_FIRST)))
