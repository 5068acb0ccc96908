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
