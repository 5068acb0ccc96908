"""Every file meshrun writes at a path the user names goes through meshrun.fsio: a symlink is
written at its target and stays a link, a FIFO or a device is written in place (never
replaced by a regular file), a socket or a directory is refused, a full disk is one line
with nothing half-written; `meshrun export` never writes into the snapshot it reads nor over
an existing model without --overwrite; bad config files and values stay one short line."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import time

import pytest
from helpers import clean_env, meshrun, require

from meshrun import fsio
from meshrun.errors import MeshrunError, bad_value

HOSTFILE = ["render", "hostfile", "--hosts", "a,b", "--gpus-per-node", "2"]
HOSTFILE_TEXT = "a slots=2\nb slots=2\n"
PLAN = ["plan", "--model", "gpt-small", "--gpu-mem", "80GiB", "--gpus-per-node", "8"]


def _one_line(res: subprocess.CompletedProcess, start: str) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshrun: error: " + start), res.stderr
    assert "Traceback" not in res.stderr
    return err[0]


def _root_only(what: str) -> None:
    """Skip where the test cannot make its special file, except under MESHRUN_TEST_STRICT=1."""
    if os.environ.get("MESHRUN_TEST_STRICT") == "1":
        pytest.fail(f"{what} needs root, and MESHRUN_TEST_STRICT=1")
    pytest.skip(f"{what} needs root")


def _char_device(path, minor: int):
    """A private copy of /dev/null (minor 3) or /dev/full (minor 7): the real ones are shared."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    except PermissionError:
        _root_only("a character device")
    return path


@contextlib.contextmanager
def _small_fs(path):
    """A 64-KiB tmpfs at ``path``, filled to the last byte: every write there is ENOSPC."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        _root_only("mounting a tmpfs")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory) -> None:
    fd = os.open(os.path.join(directory, ".filler"), os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)


def _leftovers(directory) -> list[str]:
    return [n for n in os.listdir(directory) if fsio.TMP_SUFFIX in n]


# ---- render -o onto what is already there ---------------------------------------------------

def test_render_writes_a_symlinks_target_and_keeps_the_link(tmp_path):
    (tmp_path / "real.txt").write_text("old\n")
    (tmp_path / "link").symlink_to("real.txt")
    (tmp_path / "dangling").symlink_to("made/new.txt")
    for name in ("link", "dangling"):
        res = meshrun(*HOSTFILE, "-o", str(tmp_path / name))
        assert res.returncode == 0, res.stderr
        assert os.path.islink(tmp_path / name)
    assert (tmp_path / "real.txt").read_text() == HOSTFILE_TEXT
    assert (tmp_path / "made" / "new.txt").read_text() == HOSTFILE_TEXT
    assert _leftovers(tmp_path) == []


def test_render_writes_a_fifo_in_place_and_refuses_one_nobody_reads(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    _one_line(meshrun(*HOSTFILE, "-o", str(fifo), timeout=60), f"-o={str(fifo)!r}: is a FIFO that nobody is reading")
    assert time.monotonic() - start < 30
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    time.sleep(0.2)
    res = meshrun(*HOSTFILE, "-o", str(fifo), timeout=60)
    assert res.returncode == 0, res.stderr
    assert reader.communicate(timeout=30)[0] == HOSTFILE_TEXT
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_render_writes_a_device_in_place(tmp_path):
    null, full = _char_device(tmp_path / "null", 3), _char_device(tmp_path / "full", 7)
    assert meshrun(*HOSTFILE, "-o", str(null)).returncode == 0
    _one_line(meshrun(*HOSTFILE, "-o", str(full)), f"-o={str(full)!r}: cannot be written: No space left on device")
    assert stat.S_ISCHR(os.lstat(null).st_mode) and stat.S_ISCHR(os.lstat(full).st_mode)
    assert _leftovers(tmp_path) == []
    res = meshrun(*HOSTFILE, "-o", "/dev/stdout")  # a pipe here
    assert res.returncode == 0 and res.stdout == HOSTFILE_TEXT, res.stderr


def test_render_refuses_a_socket_and_a_directory(tmp_path):
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        _one_line(meshrun(*HOSTFILE, "-o", str(tmp_path / "sock")), f"-o={str(tmp_path / 'sock')!r}: is a socket")
    finally:
        sock.close()
    assert stat.S_ISSOCK(os.lstat(tmp_path / "sock").st_mode)
    (tmp_path / "to-sock").symlink_to("sock")
    _one_line(meshrun(*HOSTFILE, "-o", str(tmp_path / "to-sock")), f"-o={str(tmp_path / 'to-sock')!r}: is a socket")
    _one_line(meshrun(*HOSTFILE, "-o", str(tmp_path)), f"-o={str(tmp_path)!r}: is a directory")


# ---- fsio itself ----------------------------------------------------------------------------

def test_a_full_disk_leaves_no_file_behind(tmp_path):
    with _small_fs(tmp_path / "small") as small:
        (small / "keep.txt").write_text("old")
        _fill(small)
        for name in ("keep.txt", "new.txt"):
            with pytest.raises(MeshrunError) as e:
                fsio.write_file(str(small / name), "x" * 100_000, source="-o")
            assert str(e.value).startswith(f"-o={str(small / name)!r}: cannot be written") and \
                "No space left on device" in str(e.value)
        assert (small / "keep.txt").read_text() == "old" and not (small / "new.txt").exists()
        assert _leftovers(small) == []


# ---- plan --write ---------------------------------------------------------------------------

def test_plan_write_on_a_full_disk_is_one_line_and_changes_nothing(tmp_path):
    with _small_fs(tmp_path / "small") as small:
        (small / "ds_config.json").write_text("{}")
        _fill(small)
        line = _one_line(meshrun(*PLAN, "--write", str(small)), "--write=")
        assert "No space left on device" in line
        assert sorted(os.listdir(small)) == [".filler", "ds_config.json"]
        assert (small / "ds_config.json").read_text() == "{}"


def test_plan_write_through_a_symlink_onto_a_full_disk_changes_no_file(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "ds_config.json").write_text("{}")
    with _small_fs(tmp_path / "small") as small:
        (out / "train.yaml").symlink_to(small / "train.yaml")
        _fill(small)
        line = _one_line(meshrun(*PLAN, "--write", str(out)),
                         f"--write={str(out / 'train.yaml')!r}: cannot be written ")
        assert f"(at {small / 'train.yaml'})" in line and "No space left on device" in line
        assert sorted(os.listdir(out)) == ["ds_config.json", "train.yaml"] and os.path.islink(out / "train.yaml")
        assert (out / "ds_config.json").read_text() == "{}" and os.listdir(small) == [".filler"]


# ---- bounded config parsing and values ------------------------------------------------------

BOMB = """a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
steps: *g
"""


def test_yaml_anchors_and_aliases_are_refused(tmp_path):
    (tmp_path / "bomb.yaml").write_text(BOMB)
    line = _one_line(meshrun("train", "--config", str(tmp_path / "bomb.yaml"), "--dry-run", timeout=60),
                     f"--config={str(tmp_path / 'bomb.yaml')!r}: uses a YAML anchor or alias (line 1)")
    assert len(line) < 400
    (tmp_path / "anchor.yaml").write_text("steps: &n 5\n")
    _one_line(meshrun("train", "--config", str(tmp_path / "anchor.yaml"), "--dry-run"), "--config=")


def test_a_huge_value_is_cut_in_the_error_line(tmp_path):
    (tmp_path / "big.yaml").write_text("steps: " + "9" * 50_000 + "\n")
    (tmp_path / "long.yaml").write_text("strategy: " + "x" * 1_000_000 + "\n")
    for name in ("big.yaml", "long.yaml"):
        line = _one_line(meshrun("train", "--config", str(tmp_path / name), "--dry-run"), "")
        assert len(line) < 600, line[:600]
    assert str(bad_value("--x", "y" * 1000, "bad")) == "--x='" + "y" * 199 + "…: bad"


def test_deeply_nested_model_json_is_one_line(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    for model in (tmp_path / "deep.json", tmp_path / "model"):
        line = _one_line(meshrun("plan", "--model", str(model), "--gpu-mem", "80GiB"), "--model=")
        assert "nests deeper than the parser allows" in line
    require("transformers")
    (tmp_path / "indexed").mkdir()
    (tmp_path / "indexed" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
         "intermediate_size": 64, "vocab_size": 128}))
    (tmp_path / "indexed" / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    _one_line(meshrun("plan", "--model", str(tmp_path / "indexed"), "--gpu-mem", "80GiB"),
              f"--model={str(tmp_path / 'indexed' / 'model.safetensors.index.json')!r}: is not a safetensors index")


def test_a_missing_value_is_named_not_shown_as_none():
    env = clean_env(CUDA_VISIBLE_DEVICES="")
    line = _one_line(meshrun("plan", "--model", "gpt-small", env=env),
                     "--gpu-mem is not given: no GPU on this machine to read it from (hint: ")
    assert "None" not in line
    for target in ("kubernetes", "saturn"):
        line = _one_line(meshrun("render", target, "--", "train.py"), "--image is not given: ")
        assert "None" not in line


# ---- export ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> str:
    """A committed snapshot of a one-layer Llama (a Hugging Face model: both export formats)."""
    require("transformers")
    import transformers

    root = tmp_path_factory.mktemp("export")
    transformers.LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=64,
                             max_position_embeddings=64).save_pretrained(root / "model")
    res = meshrun("train", "--model", str(root / "model"), "--steps", "1", "--nproc", "1", "--seq-len", "16",
                  "--micro-batch", "2", "--data", "random", "--out", str(root / "run"), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return str(root / "run" / "checkpoints" / "step-00000001")


def _tree(path) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, n), path): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(path) for n in names}


@pytest.mark.framework
@pytest.mark.parametrize("to,fmt", [("SNAP/model.safetensors", "auto"), ("LINK/exported", "hf")])
def test_export_never_writes_into_the_run_it_reads(snapshot, tmp_path, to, fmt):
    checkpoints = os.path.dirname(snapshot)
    (tmp_path / "link").symlink_to(checkpoints)
    before = _tree(checkpoints)
    target = to.replace("SNAP", snapshot).replace("LINK", str(tmp_path / "link"))
    _one_line(meshrun("export", os.path.dirname(snapshot), "--to", target, "--format", fmt),
              f"--to={target!r}: is inside ")
    assert _tree(checkpoints) == before


@pytest.mark.framework
def test_export_refuses_a_model_directory_and_overwrite_moves_it_aside(snapshot, tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    stale = {"model-00001-of-00002.safetensors": b"old", "model-00002-of-00002.safetensors": b"old",
             "model.safetensors.index.json": b'{"weight_map": {}}', "config.json": b"{}"}
    for name, data in stale.items():
        (target / name).write_bytes(data)
    _one_line(meshrun("export", snapshot, "--to", str(target)), f"--to={str(target)!r}: is not empty (hint: ")
    assert _tree(target) == stale
    res = meshrun("export", snapshot, "--to", str(target), "--overwrite")
    assert res.returncode == 0, res.stderr
    (aside,) = [p for p in os.listdir(tmp_path) if p.startswith("model.old-")]
    assert f"aside to {tmp_path / aside}" in res.stdout
    assert _tree(tmp_path / aside) == stale
    assert sorted(os.listdir(target)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.framework
def test_export_refuses_an_existing_file(snapshot, tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"mine")
    _one_line(meshrun("export", snapshot, "--to", str(target)), f"--to={str(target)!r}: exists (hint: ")
    assert target.read_bytes() == b"mine"


def test_set_aside_moves_the_old_file_or_directory_beside_it(tmp_path):
    (tmp_path / "m.bin").write_bytes(b"mine")
    written = fsio.write_file_with(str(tmp_path / "m.bin"), lambda p: open(p, "wb").write(b"new"), source="--to",
                                   set_aside=True)
    assert written.moved_aside and os.path.basename(written.moved_aside).startswith("m.bin.old-")
    assert open(written.moved_aside, "rb").read() == b"mine" and (tmp_path / "m.bin").read_bytes() == b"new"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "stale.json").write_text("{}")
    with pytest.raises(MeshrunError, match="is not empty"):
        fsio.write_dir(str(tmp_path / "d"), lambda stage: None, source="--to")
    written = fsio.write_dir(str(tmp_path / "d"), lambda stage: open(os.path.join(stage, "new.json"), "w").close(),
                             source="--to", set_aside=True)
    assert os.listdir(tmp_path / "d") == ["new.json"] and os.listdir(written.moved_aside) == ["stale.json"]


def test_a_directory_on_a_full_disk_is_not_left_behind(tmp_path):
    def fill(stage: str) -> None:
        with open(os.path.join(stage, "config.json"), "w") as f:
            f.write("x" * 100_000)

    with _small_fs(tmp_path / "small") as small:
        _fill(small)
        with pytest.raises(MeshrunError, match="No space left on device"):
            fsio.write_dir(str(small / "exported"), fill, source="--to")
        assert os.listdir(small) == [".filler"]


@pytest.mark.framework
def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(snapshot, tmp_path):
    with _small_fs(tmp_path / "small") as small:
        _fill(small)
        target = str(small / "model.safetensors")
        line = _one_line(meshrun("export", snapshot, "--to", target), f"--to={target!r}: cannot be written: ")
        assert "No space left on device" in line
        assert os.listdir(small) == [".filler"]


def test_fsio_imports_only_the_standard_library_and_errors():
    import ast

    tree = ast.parse(open(fsio.__file__).read())
    mine = {(node.level, node.module) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
    absolute = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    absolute |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level}
    assert mine == {(1, "errors")} and not {m for m in absolute if m.split(".")[0] == "meshrun"}


def test_a_file_size_limit_is_one_line_not_a_signal(tmp_path):
    """Under `ulimit -f` a write past the limit would kill meshrun with SIGXFSZ, leaving a
    partial file: meshrun ignores the signal, so the write fails (EFBIG) and is one line."""
    import resource
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))

    out = tmp_path / "configs"
    res = subprocess.run([sys.executable, "-m", "meshrun", "plan", "--model", "gpt-124m", "--gpu-mem", "80GiB",
                          "--gpus-per-node", "8", "--write", str(out)], env=clean_env(), preexec_fn=limit,
                         capture_output=True, text=True, timeout=120)
    line = _one_line(res, "--write=")
    assert "File too large" in line and "ulimit -f" in line, line
    assert not out.exists() or os.listdir(out) == []
