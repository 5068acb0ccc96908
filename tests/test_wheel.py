"""The wheel users install holds every file the package reads at run time.

The package's own files are read through importlib.resources (never a path built from
``__file__``), and each one so read, like every other non-Python file under src/meshrun, must
be in the built wheel: an editable install reads the source tree and would not notice."""

import ast
import os
import shutil
import subprocess
import sys
import zipfile

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "meshrun")


def _modules():
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def resources_read() -> set[str]:
    """Wheel paths of the files the code reads as ``resources.files(__package__).joinpath("NAME")``."""
    found = set()
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "joinpath"
                    and isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Attribute)
                    and node.func.value.func.attr == "files"):
                (name,) = node.args
                assert isinstance(name, ast.Constant), f"{path}: a resource named at run time is not checkable"
                rel = os.path.relpath(os.path.dirname(path), os.path.dirname(PACKAGE))
                found.add(f"{rel}/{name.value}".replace(os.sep, "/"))
    return found


def data_files() -> set[str]:
    """Wheel paths of every non-Python file in the package's source tree."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if not name.endswith((".py", ".pyc")):
                found.add(os.path.relpath(os.path.join(dirpath, name), os.path.dirname(PACKAGE)).replace(os.sep, "/"))
    return found


def test_the_code_reads_no_package_file_by_a_path_from_dunder_file():
    # A path next to __file__ works from the source tree and from a wheel only if the file was
    # shipped; importlib.resources is the one way in, so resources_read() sees every read.
    offenders = []
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            if "__file__" in f.read():
                offenders.append(os.path.relpath(path, PACKAGE))
    assert offenders == []


def test_the_wheel_holds_every_file_the_package_reads(tmp_path):
    # Built from a copy of the project, so the build leaves nothing in the working tree.
    project = os.path.dirname(os.path.dirname(PACKAGE))
    copy = tmp_path / "project"
    shutil.copytree(os.path.join(project, "src"), copy / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(project, name), copy / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"),
                          str(copy)], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "dist").glob("meshrun-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    read = resources_read()
    assert sorted((read | data_files()) - names) == []
    assert "meshrun/plan/calibration.json" in read  # the scan finds the reads it is meant to
