"""Checks for paths meshrun will write to, made before any work starts, so that a file where
a directory belongs (or a directory nobody may write) is a one-line error, not a traceback
from deep inside a run. Nothing is created here: a refused command leaves no trace."""

from __future__ import annotations

import os

from .errors import bad_value


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
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(full):
        if not os.path.isdir(full):
            raise bad_value(source, path, "exists and is not a directory", "give a directory, or move the file away")
        if not _writable(full):
            raise bad_value(source, path, "directory is not writable", "choose a writable directory")
        return
    _creatable(full, source, path)


def check_output_file(path: str, source: str) -> None:
    """A file meshrun writes (replacing any file there): not a directory, and writable or creatable."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(full):
        raise bad_value(source, path, "is a directory; a file is written here", "give a file name")
    if os.path.exists(full):
        if not os.access(full, os.W_OK):
            raise bad_value(source, path, "file is not writable", "choose a writable location")
        return
    _creatable(os.path.dirname(full), source, path)
