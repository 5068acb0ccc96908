"""The one way meshrun writes a file the user named (`render -o`, `plan --write`, `export --to`).

What is at the path decides how it is written:

- nothing, or a regular file: a temporary file beside it is filled, flushed to disk and
  renamed over it, so the path holds the old content or the whole new one, never a part;
- a symlink to either: the same at the link's target; the link stays a link;
- a FIFO or a character device (``/dev/stdout``, a terminal, ``/dev/null``): written in
  place, never replaced by a regular file; a FIFO nobody reads is refused at once (it is
  opened non-blocking), not waited on forever;
- a directory, a socket, a block device: refused before anything is written.

A write that fails (a full disk, a file too large, an I/O error, no permission, a read-only
filesystem) is one line naming the path and the cause, and leaves no temporary file behind.
Only the standard library and meshrun.errors are imported: every layer may use this.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

from .errors import MeshrunError, bad_value

# Fills the file at the path it is given with the whole content (a library's save_file).
Fill = Callable[[str], None]

TMP_SUFFIX = ".meshrun-tmp"
ASIDE_INFIX = ".old-"
_CHUNK = 1 << 20
_OPEN_FD = re.compile(r"/dev/(stdout|stderr|fd/\d+)$|/proc/(self|\d+)/fd/\d+$")

_HINTS = {
    errno.ENOSPC: "free space on that filesystem, or write somewhere else",
    errno.EDQUOT: "free space within your quota, or write somewhere else",
    errno.EFBIG: "the filesystem or a file size limit (ulimit -f) is too small for it: write somewhere else",
    errno.EIO: "the device reported an I/O error: check it, or write somewhere else",
    errno.EACCES: "choose a location you may write",
    errno.EPERM: "choose a location you may write",
    errno.EROFS: "the filesystem is read-only: choose a writable location",
    errno.EPIPE: "the reader went away before everything was written; keep it reading",
    errno.ELOOP: "the path is a loop of symlinks: fix the link, or give another path",
    errno.ENOTDIR: "a file stands where a directory of the path belongs: choose another path",
    errno.EXDEV: "move the old files away yourself, or choose another path",
}


class Written(NamedTuple):
    """Where the content went (a symlink's target, not the link) and, when the file or
    directory there was moved aside first, where the old one now is."""

    path: str
    moved_aside: str | None = None


# ---- what is at a path ------------------------------------------------------------------

def file_kind(mode: int) -> str:
    """What a stat mode is, as an error line names it: "a regular file", "a directory", "a FIFO", ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "a special file"


def _full(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _kind(path: str, source: str) -> tuple[str, str]:
    """("new" | "regular" | "append" | "fifo" | "char", the path to write): a regular file or
    one to create is written at the real path (through every symlink); a FIFO or a character
    device is opened by the path as given (``/dev/stdout`` resolves through /proc to names
    that are no paths), and so is a regular file named by one of this process's open
    descriptors (``/dev/stdout``, ``/dev/fd/N``), appended to. Anything else is refused in
    one line."""
    full = _full(path)
    try:
        st = os.stat(full)
    except FileNotFoundError:
        return "new", os.path.realpath(full)  # a dangling symlink: its target is created
    except OSError as exc:
        raise write_error(source, path, exc) from None
    if stat.S_ISREG(st.st_mode):
        if _OPEN_FD.match(full):  # `-o /dev/stdout > log`: add to the shell's file, as a write to fd 1 would
            return "append", full
        return "regular", os.path.realpath(full)
    if stat.S_ISFIFO(st.st_mode):
        return "fifo", full
    if stat.S_ISCHR(st.st_mode):
        return "char", full
    if stat.S_ISDIR(st.st_mode):
        raise bad_value(source, path, "is a directory; a file is written here", "give a file name")
    what = "a socket" if stat.S_ISSOCK(st.st_mode) else "a block device" if stat.S_ISBLK(st.st_mode) \
        else "not a regular file"
    raise bad_value(source, path, f"is {what}; meshrun writes only to a regular file, a FIFO or a character device",
                    "give a file name")


def check_file_target(path: str, source: str, existing_hint: str | None = None) -> str:
    """What :func:`write_file` would do with ``path``, checked before any work: the kind it
    is ("new", "regular", "append", "fifo", "char"); refused in one line when it cannot be written.
    With ``existing_hint``, a regular file already there is refused too, with that hint."""
    kind, real = _kind(path, source)
    if kind == "regular":
        if existing_hint is not None:
            raise bad_value(source, path, "exists", existing_hint)
        if not os.access(real, os.W_OK):
            raise bad_value(source, path, "file is not writable", "choose a writable location")
    if kind in ("new", "regular"):
        _check_creatable(os.path.dirname(real), source, path)
    return kind


def check_dir_target(path: str, source: str, nonempty_hint: str | None = None) -> None:
    """A directory :func:`write_dir` fills: an existing directory (through its symlinks) or a
    path that can be made one. With ``nonempty_hint``, a directory holding anything is
    refused with that hint."""
    real = os.path.realpath(_full(path))
    if os.path.lexists(real) and not os.path.isdir(real):
        raise bad_value(source, path, "exists and is not a directory", "give a directory, or move the file away")
    if os.path.isdir(real):
        if not os.access(real, os.W_OK | os.X_OK):
            raise bad_value(source, path, "directory is not writable", "choose a writable directory")
        if nonempty_hint is not None and os.listdir(real):
            raise bad_value(source, path, "is not empty", nonempty_hint)
        return
    _check_creatable(real, source, path)


def _check_creatable(directory: str, source: str, raw: str) -> None:
    """``directory`` is one, writable, or its closest existing ancestor is."""
    base = directory
    while not os.path.exists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        raise bad_value(source, raw, f"cannot be created: {base} is a file, not a directory",
                        "choose a path under a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise bad_value(source, raw, f"cannot be created: {base} is not writable", "choose a writable location")


def write_error(source: str, path: str, exc: OSError, real: str | None = None) -> MeshrunError:
    """The one line for a failed write: the path as given (and the file it resolves to when
    that differs), the system's words for the cause, and what to do."""
    cause = exc.strerror or str(exc) or type(exc).__name__
    where = f" (at {real})" if real and real != _full(path) else ""
    return bad_value(source, path, f"cannot be written{where}: {cause}",
                     _HINTS.get(exc.errno or 0, "choose another location"))


# ---- writing ----------------------------------------------------------------------------

def write_file(path: str, data: bytes | str, *, source: str, mode: int = 0o644) -> str:
    """Write ``data`` (text as UTF-8) to ``path`` as this module's docstring says; returns the
    path the bytes went to."""
    return write_files({path: data}, source=source, mode=mode)[0]


def write_files(files: dict[str, bytes | str], *, source: str, mode: int = 0o644) -> list[str]:
    """Write several files as one: every regular file's temporary is filled first, and only
    when all are whole are they renamed into place (a full disk leaves none of them changed);
    FIFOs and devices are written last. Returns the paths written, in order."""
    staged: list[tuple[str, str, str, str, bytes]] = []  # (path, kind, where, temporary, data)
    temps: list[str] = []
    try:
        for path, data in files.items():
            blob = data.encode() if isinstance(data, str) else data
            kind, where = _kind(path, source)
            tmp = ""
            if kind in ("new", "regular"):
                tmp = _fill_temp(where, functools.partial(_write_bytes, data=blob), source, path, mode, temps)
            staged.append((path, kind, where, tmp, blob))
        for path, kind, where, tmp, blob in staged:
            if tmp:
                _replace(tmp, where, source, path)
                temps.remove(tmp)
            else:
                _write_in_place(where, kind, functools.partial(_write_all, data=blob), source, path)
        return [where for _, _, where, _, _ in staged]
    finally:
        for tmp in temps:
            _remove(tmp)


def write_file_with(path: str, fill: Fill, *, source: str, mode: int = 0o644, set_aside: bool = False) -> Written:
    """Write ``path`` with ``fill``, which writes the whole content to the file path it is
    given (a library's ``save_file``). With ``set_aside``, a regular file already there is
    renamed to ``PATH.old-<UTC time>`` instead of replaced."""
    kind, where = _kind(path, source)
    if kind not in ("new", "regular"):
        _fill_in_place(where, kind, fill, source, path)
        return Written(where)
    temps: list[str] = []
    try:
        tmp = _fill_temp(where, fill, source, path, mode, temps)
        moved = None
        if set_aside and os.path.lexists(where):
            moved = _rename_aside(where, source, path)
        _replace(tmp, where, source, path)
        temps.clear()
        return Written(where, moved)
    finally:
        for tmp in temps:
            _remove(tmp)


def write_dir(path: str, fill: Fill, *, source: str, set_aside: bool = False,
              nonempty_hint: str = "choose an empty or new directory") -> Written:
    """Fill a directory with ``fill`` (``save_pretrained``), whole or not at all: ``fill``
    writes into a private directory inside the target (same filesystem), whose files are
    renamed into place only once it has returned. A directory holding files is refused,
    unless ``set_aside``: its entries are then moved into the sibling ``DIR.old-<UTC time>``
    after the new files are complete, so no old file mixes with the new set. On failure,
    nothing new is left (and a directory this call made is removed)."""
    real = os.path.realpath(_full(path))
    check_dir_target(path, source, None if set_aside else nonempty_hint)
    created, done = not os.path.isdir(real), False
    stage = ""
    try:
        os.makedirs(real, exist_ok=True)
        stage = tempfile.mkdtemp(dir=real, prefix=".meshrun-", suffix=TMP_SUFFIX)
        fill(stage)
        _sync_tree(stage)
        old = [n for n in os.listdir(real) if n != os.path.basename(stage)]
        if old and not set_aside:  # files that appeared while fill ran
            raise bad_value(source, path, "is not empty", nonempty_hint)
        moved = _move_entries_aside(real, old) if old else None
        for name in os.listdir(stage):
            os.rename(os.path.join(stage, name), os.path.join(real, name))
        os.rmdir(stage)
        done = True
        return Written(real, moved)
    except OSError as exc:
        raise write_error(source, path, exc, real) from None
    finally:
        if not done:
            if stage:
                shutil.rmtree(stage, ignore_errors=True)
            if created:
                _rmdir_quietly(real)


def aside_name(real: str) -> str:
    """``PATH.old-<UTC time>``, numbered when two are made within one second."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target, n = f"{real}{ASIDE_INFIX}{stamp}", 1
    while os.path.lexists(target):
        n += 1
        target = f"{real}{ASIDE_INFIX}{stamp}-{n}"
    return target


# ---- helpers ----------------------------------------------------------------------------

def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _fill_temp(real: str, fill: Fill, source: str, path: str, mode: int, temps: list[str]) -> str:
    """A temporary file beside ``real``, filled, flushed to disk, with ``mode``; recorded in
    ``temps`` as soon as it exists, for the caller to remove on any failure."""
    try:
        os.makedirs(os.path.dirname(real), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(real), prefix=f".{os.path.basename(real)}.",
                                   suffix=TMP_SUFFIX)
        os.close(fd)
        temps.append(tmp)
        fill(tmp)
        _sync(tmp)
        os.chmod(tmp, mode)
        return tmp
    except OSError as exc:
        raise write_error(source, path, exc, real) from None


def _replace(tmp: str, real: str, source: str, path: str) -> None:
    try:
        os.replace(tmp, real)
    except OSError as exc:
        raise write_error(source, path, exc, real) from None


def _rename_aside(real: str, source: str, path: str) -> str:
    target = aside_name(real)
    try:
        os.rename(real, target)
    except OSError as exc:
        raise write_error(source, path, exc, real) from None
    return target


def _move_entries_aside(real: str, names: list[str]) -> str:
    """Move ``names`` of directory ``real`` into a new sibling ``real.old-<time>``; when one
    cannot be moved, those already moved go back and the sibling is removed."""
    target = aside_name(real)
    os.makedirs(target)
    moved: list[str] = []
    try:
        for name in names:
            os.rename(os.path.join(real, name), os.path.join(target, name))
            moved.append(name)
    except OSError:
        for name in reversed(moved):
            os.rename(os.path.join(target, name), os.path.join(real, name))
        _rmdir_quietly(target)
        raise
    return target


def _open_in_place(where: str, kind: str, source: str, path: str) -> int:
    """A FIFO or a character device opened for writing, blocking; a FIFO with no reader is
    refused rather than waited on."""
    flags = os.O_WRONLY | os.O_CLOEXEC | (os.O_NONBLOCK if kind == "fifo" else os.O_APPEND if kind == "append" else 0)
    try:
        fd = os.open(where, flags)
    except OSError as exc:
        if kind == "fifo" and exc.errno == errno.ENXIO:
            raise bad_value(source, path, "is a FIFO that nobody is reading",
                            "start its reader first (e.g. cat PATH), or give a file name") from None
        raise write_error(source, path, exc) from None
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def _write_in_place(where: str, kind: str, write: Callable[[int], None], source: str, path: str) -> None:
    fd = _open_in_place(where, kind, source, path)
    try:
        write(fd)
    except OSError as exc:
        raise write_error(source, path, exc, os.path.realpath(where)) from None
    finally:
        os.close(fd)


def _fill_in_place(where: str, kind: str, fill: Fill, source: str, path: str) -> None:
    """``fill`` writes a path, not a stream: into a private temporary file, whose bytes are then
    copied to the FIFO or device."""
    fd, tmp = tempfile.mkstemp(suffix=TMP_SUFFIX)
    os.close(fd)
    try:
        try:
            fill(tmp)
        except OSError as exc:
            raise write_error(source, path, exc, tmp) from None
        _write_in_place(where, kind, lambda out: _copy(tmp, out), source, path)
    finally:
        _remove(tmp)


def _copy(src: str, fd: int) -> None:
    with open(src, "rb") as f:
        while chunk := f.read(_CHUNK):
            _write_all(fd, chunk)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _sync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(root: str) -> None:
    for dirpath, _, names in os.walk(root):
        for name in names:
            _sync(os.path.join(dirpath, name))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _rmdir_quietly(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
