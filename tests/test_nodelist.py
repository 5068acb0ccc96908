import pytest

from meshrun.cluster.nodelist import expand_nodelist
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
