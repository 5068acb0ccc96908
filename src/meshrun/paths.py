"""Checks for paths meshrun will write to, made before any work starts, so that a file where
a directory belongs (or a directory nobody may write) is a one-line error, not a traceback
from deep inside a run. Nothing is created here: a refused command leaves no trace."""

from __future__ import annotations

import os

from .errors import bad_value
from .fsio import check_file_target


def check_path_text(path: str, source: str) -> None:
    """A path a user names, as text, whatever it names: not empty, no control character (a
    newline or a tab pasted in with it), no space at either end (a quoting slip: ``--out " a"``
    would write into a directory whose name starts with a space), and nothing the file system
    cannot encode. The same rule for every path a command, a variable, a config file or a
    keyword gives."""
    if not path:
        raise bad_value(source, path, "is an empty path", "give a path, or leave the option out")
    control = next((c for c in path if ord(c) < 32 or ord(c) == 127), None)
    if control is not None:
        raise bad_value(source, path, f"contains the control character {control!r}", "remove it from the path")
    if path != path.strip():
        raise bad_value(source, path, "starts or ends with a space", "remove the spaces around the path")
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        raise bad_value(source, path, "has characters the file system cannot encode", "rename it") from None


def nearest_existing(path: str) -> str:
    """``path`` itself when it exists, else its closest ancestor that does."""
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _writable(path: str) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def _creatable(path: str, source: str, raw: str) -> None:
    """``path`` does not exist: its closest existing ancestor must be a directory we may write."""
    base = nearest_existing(path)
    if not os.path.isdir(base):
        raise bad_value(source, raw, f"cannot be created: {base} is a file, not a directory",
                        "choose a path under a directory")
    if not _writable(base):
        raise bad_value(source, raw, f"cannot be created: {base} is not writable", "choose a writable location")


def check_output_dir(path: str, source: str) -> None:
    """A directory meshrun writes into: an existing writable directory, or a path it can create."""
    check_path_text(path, source)
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(full):
        if not os.path.isdir(full):
            raise bad_value(source, path, "exists and is not a directory", "give a directory, or move the file away")
        if not _writable(full):
            raise bad_value(source, path, "directory is not writable", "choose a writable directory")
        return
    _creatable(full, source, path)


def check_output_file(path: str, source: str) -> None:
    """A file meshrun writes through meshrun.fsio (replacing a regular file there, writing a
    FIFO or a device in place): not a directory, socket or block device, and writable or
    creatable."""
    check_path_text(path, source)
    check_file_target(path, source)
