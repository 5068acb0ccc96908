import time

import pytest

from meshrun.cluster.nodelist import MAX_HOSTS, expand_nodelist
from meshrun.errors import MeshrunError


@pytest.mark.parametrize("text,hosts", [
    ("node1", ["node1"]),
    ("gpu[01-04,07],login2", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "login2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("a[1-2],b[3,5]", ["a1", "a2", "b3", "b5"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("gpu[1]-ib", ["gpu1-ib"]),
    ("x1,x2 ", ["x1", "x2"]),
])
def test_expand(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["gpu[01-", "gpu01]", "gpu[a-b]", "gpu[5-3]", "a,,b", "gpu[]", ""])
def test_bad_nodelist_is_one_line_error(text):
    with pytest.raises(MeshrunError) as e:
        expand_nodelist(text)
    assert "SLURM_JOB_NODELIST" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text,hosts", [
    ("a, b", ["a", "b"]),
    (" gpu[1-2] ,  login2", ["gpu1", "gpu2", "login2"]),
    ("n[ 1 - 2 , 4 ]", ["n1", "n2", "n4"]),
])
def test_blanks_around_items_are_not_part_of_host_names(text, hosts):
    assert expand_nodelist(text) == hosts


def test_a_list_at_the_bound_expands():
    hosts = expand_nodelist("gpu[00001-100000]")
    assert len(hosts) == MAX_HOSTS == 100_000 and hosts[0] == "gpu00001" and hosts[-1] == "gpu100000"


@pytest.mark.parametrize("text,count", [
    ("gpu[0-99999999]", 100_000_000),
    ("gpu[0-99999],login[1-2]", 100_002),
    ("r[1-1000]-n[1-1000]", 1_000_000),
    ("gpu[0-" + "9" * 40 + "]", 10 ** 40),
])
def test_a_huge_list_is_refused_before_it_is_expanded(text, count):
    start = time.perf_counter()
    with pytest.raises(MeshrunError) as e:
        expand_nodelist(text, "SLURM_STEP_NODELIST")
    assert time.perf_counter() - start < 0.5
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("env SLURM_STEP_NODELIST=")
    assert f"names {count} hosts, more than the 100000" in msg
