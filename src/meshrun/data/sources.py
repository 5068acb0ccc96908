"""The documents of a text corpus, in a fixed order (files sorted by path), so that a
preparation interrupted and run again sees the same sequence:

- ``.txt``/``.md``/``.text``, and files of the extensions ``--ext`` adds (``.py``): a file is
  one document;
- ``.jsonl``: a line is one document, its ``text`` field (or the one named);
- ``.parquet``: a row is one document, its text column (pyarrow);
- a directory written by ``datasets``' ``save_to_disk``: a row is one document (its ``train``
  split when it holds several);
- a directory: every such file under it, recursively; the others are counted by extension
  (``Source.skipped``) for the line that says what was left out.

Empty documents are skipped (they would be an end-of-document token alone)."""

from __future__ import annotations

import json
import os
import stat
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

from ..errors import MeshrunError, bad_value, first_line
from ..fsio import file_kind
from . import INDEX

if TYPE_CHECKING:
    from .chat import ChatKind

# The default corpus of `meshrun train` (--data stdlib), read as bytes: its last 5% is held out
STDLIB_VAL_FRACTION = 0.05
TEXT_SUFFIXES = (".txt", ".md", ".text")
FORMAT_SUFFIXES = (".jsonl", ".parquet")  # files read by their format, a document a line or row
SUFFIXES = (*TEXT_SUFFIXES, *FORMAT_SUFFIXES)
EXT_HINT = "an extension such as .py (or py); several as .py,.pyi or --ext repeated"
NO_EXTENSION = "no extension"
SKIPPED_SHOWN = 6  # extensions the skipped line names; the rest are summed
DataKind = Literal["tokens", "text"]  # what a --data path holds (data_kind)
# A JSON line is parsed whole: its bytes, its text and the parsed record are in memory at once
MAX_LINE_BYTES = 256 << 20


@dataclass(frozen=True)
class Source:
    """A corpus: its files (or a saved dataset directory) and the text field."""

    paths: tuple[str, ...]
    dataset: bool  # a `datasets` save_to_disk directory
    text_field: str
    extensions: tuple[str, ...] = ()  # read as text besides TEXT_SUFFIXES (--ext), sorted
    skipped: tuple[tuple[str, int], ...] = ()  # files of the directory not read: (extension, count), most first
    skipped_text: tuple[str, ...] = ()  # those of the commonest extensions whose first file reads as text
    directory: bool = False  # read from a directory: a file in it that is not UTF-8 is left out, and said
    chat: ChatKind | None = None  # chat or instruction records (chat.py's rule), None for text

    def fingerprint(self) -> list[list[str | int]]:
        """What a prepared corpus was made from: each input's path, size and modification time."""
        return [list(entry) for entry in self.inputs()]

    def inputs(self) -> list[tuple[str, int, int]]:
        """Each input file: its absolute path, size and modification time (whole seconds)."""
        out = []
        for p in self.paths:
            files = [p] if os.path.isfile(p) else sorted(
                os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs)
            for f in files:
                st = _stat(f)
                out.append((os.path.abspath(f), st.st_size, int(st.st_mtime)))
        return out


def _gone(path: str, exc: OSError) -> MeshrunError:
    """The one line for an input that could not be read (deleted or moved while in use, or unreadable)."""
    if isinstance(exc, FileNotFoundError):
        return MeshrunError(f"{path}: no longer there: deleted or moved while meshrun read the corpus "
                            "(hint: run it again once the corpus is complete and stays put)")
    return MeshrunError(f"{path}: cannot be read ({exc.strerror or exc}) (hint: check the file and its permissions)")


def check_regular(path: str, where: str, hint: str = "give a regular file, or move it out of the corpus") -> None:
    """``path`` (a name the user's corpus holds) is a regular file, through symlinks: a FIFO
    would block the first read forever, a device read without end."""
    mode = _stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise bad_value(where, path, f"is {file_kind(mode)}, not a regular file", hint)


def _stat(path: str) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as exc:
        raise _gone(path, exc) from None


def data_kind(path: str) -> DataKind | None:
    """What a ``--data`` path holds: ``tokens`` (a prepared corpus, a ``.bin`` token file or a
    directory of them), ``text`` (a corpus file or directory, or a saved dataset), or None."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, INDEX)) or any(f.endswith(".bin") for f in os.listdir(path)):
            return "tokens"
        return "text"
    if os.path.isfile(path):
        return "tokens" if path.endswith(".bin") else "text"
    return None


def chat_kind(path: str, text_field: str = "text", where: str = "--data",
              extensions: tuple[str, ...] = ()) -> ChatKind | None:
    """Whether a ``--data`` path holds chat data and which (chat.py's rule): a prepared corpus
    by its index's chat record, text by its first ``.jsonl`` record; None otherwise."""
    path = os.path.expanduser(path)
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, "rb") as f:
                info = json.loads(f.read()).get("chat")
        except (OSError, ValueError, RecursionError, AttributeError):
            return None  # (opening the corpus names what is wrong with it)
        kind = info.get("kind") if isinstance(info, dict) else None
        return kind if kind in ("messages", "prompt-completion") else None
    if data_kind(path) != "text" or is_saved_dataset(path) or not (os.path.isdir(path) or path.endswith(".jsonl")):
        return None
    return find_source(path, text_field, where, extensions).chat


def stdlib_files() -> list[str]:
    """The files of `meshrun train`'s default corpus (--data stdlib): the running Python's
    standard library source, in sorted path order, without installed packages and caches: a
    real text corpus on every machine with Python, so the default job downloads nothing."""
    paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(sysconfig.get_paths()["stdlib"]):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        paths += [os.path.join(dirpath, name) for name in sorted(filenames) if name.endswith(".py")]
    return paths


def is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, n))
                                       for n in ("dataset_info.json", "dataset_dict.json", "state.json"))


def text_extensions(value: str | None, where: str = "--ext") -> tuple[str, ...]:
    """The extensions a comma list names (``py`` or ``.py``), each with its dot, sorted, without
    the ones read as text already; one line naming ``value`` for an empty name, one with a
    path separator, or one that is no file extension."""
    if value is None:
        return ()
    found: set[str] = set()
    for item in value.split(","):
        name = item.strip()
        ext = name if name.startswith(".") else "." + name
        if ext == ".":
            raise bad_value(where, value, "an empty extension", EXT_HINT)
        if "/" in ext or "\\" in ext or os.sep in ext:
            raise bad_value(where, value, f"{name!r} holds a path separator: an extension is how a file's name ends",
                            EXT_HINT)
        if ext.endswith(".") or ".." in ext or not all(c.isalnum() or c in "._+-" for c in ext):
            raise bad_value(where, value, f"{name!r} is not a file extension (letters, digits, _ + - after a dot)",
                            EXT_HINT)
        if ext in FORMAT_SUFFIXES:
            raise bad_value(where, value, f"{ext} files are read by their format already, a document a "
                            f"{'line' if ext == '.jsonl' else 'row'}", "drop it: --ext adds files read whole as "
                            "one document each")
        if ext not in TEXT_SUFFIXES:
            found.add(ext)
    return tuple(sorted(found))


def extension(name: str) -> str:
    """How a file's name ends, as the skipped line counts it: ``.py``, or ``no extension``."""
    return os.path.splitext(name)[1] or NO_EXTENSION


def skipped_summary(skipped: tuple[tuple[str, int], ...]) -> str:
    """``673 files: .py 668, .c 3, no extension 2``: the extensions most found first, at most
    SKIPPED_SHOWN of them, the rest summed."""
    total = sum(n for _, n in skipped)
    parts = [f"{ext} {n:,}" for ext, n in skipped[:SKIPPED_SHOWN]]
    rest = skipped[SKIPPED_SHOWN:]
    if rest:
        parts.append(f"{sum(n for _, n in rest):,} more of {len(rest)} other extension{'s' if len(rest) > 1 else ''}")
    return f"{total:,} file{'s' if total != 1 else ''}: {', '.join(parts)}"


def skipped_hint(skipped_text: tuple[str, ...]) -> str:
    """How to read skipped files: --ext with the commonest of their extensions whose files are
    text (``Source.skipped_text``)."""
    if skipped_text:
        return f"--ext {skipped_text[0]} reads {skipped_text[0]} files as text too, one document each"
    return "--ext EXT reads the files of an extension as text, one document each"


def _reads_as_text(path: str) -> bool:
    """Whether a regular file's first 4 KiB are UTF-8 text without NUL bytes (a character cut
    at the end aside): a sample of a skipped extension, to name only text ones in a hint."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # (a FIFO would block the read)
            return False
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.reason == "unexpected end of data"
    return True


def find_source(path: str, text_field: str = "text", where: str = "--data",
                extensions: tuple[str, ...] = ()) -> Source:
    """The corpus at ``path``, or a one-line error naming what is wrong with it. ``extensions``
    (``text_extensions``'s): files read as text besides TEXT_SUFFIXES."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise bad_value(where, path, "no such file or directory")
    if is_saved_dataset(path):
        return Source((path,), True, text_field, extensions)
    suffixes = (*SUFFIXES, *extensions)
    if not os.path.isdir(path):
        check_regular(path, where, "give a corpus file or a directory of them")
        if not path.endswith(suffixes):
            ext = extension(path)
            hint = f"one of {', '.join(suffixes)}, or a directory"
            raise bad_value(where, path, "not a text corpus file",
                            hint + (f"; --ext {ext} reads {ext} files as text" if ext != NO_EXTENSION else ""))
        return Source((path,), False, text_field, extensions, chat=_chat_kind((path,), text_field, where))
    files: list[str] = []
    others: Counter[str] = Counter()
    first: dict[str, str] = {}  # each skipped extension's first file, in sorted order
    for d, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            if name.endswith(suffixes):
                files.append(os.path.join(d, name))
            else:
                others[extension(name)] += 1
                first.setdefault(extension(name), os.path.join(d, name))
    files.sort()
    skipped = tuple(sorted(others.items(), key=lambda kv: (-kv[1], kv[0])))
    text = tuple(ext for ext, _ in skipped[:SKIPPED_SHOWN] if ext != NO_EXTENSION and _reads_as_text(first[ext]))
    for name in files:  # all of them before any is read: one of them a FIFO would hang the read
        check_regular(name, where)
    if not files:
        held = f" (it holds {skipped_summary(skipped)})" if skipped else ""
        raise bad_value(where, path, f"a directory with no {', '.join(suffixes)} file in it{held}",
                        (skipped_hint(text) + ", or " if skipped else "") + "point at the corpus' files or folder")
    return Source(tuple(files), False, text_field, extensions, skipped, text, directory=True,
                  chat=_chat_kind(tuple(files), text_field, where))


def _chat_kind(files: tuple[str, ...], text_field: str, where: str) -> ChatKind | None:
    """The chat kind of a corpus by the first record of its first ``.jsonl`` file (chat.py's
    rule); a chat corpus is ``.jsonl`` files alone (one line naming another file otherwise)."""
    from .chat import EXAMPLE_WORDS, detect

    first = next((f for f in files if f.endswith(".jsonl")), None)
    kind = detect(first, text_field) if first is not None else None
    if kind is not None:
        other = next((f for f in files if not f.endswith(".jsonl")), None)
        if other is not None:
            raise bad_value(where, other, f"not a .jsonl file, in a corpus of {EXAMPLE_WORDS[kind][1]} ({first}'s "
                            "first record)", "a chat corpus is .jsonl files alone; move the others out of it")
    return kind


def _field(record: object, field: str, where: str) -> str:
    from .chat import record_kind

    kind = record_kind(record, field)
    if kind in ("messages", "prompt-completion"):
        raise MeshrunError(f"{where}: a {'conversation' if kind == 'messages' else 'prompt/completion record'} in a "
                           f"corpus of text (its first record has the {field!r} field) (hint: one kind of record "
                           "per corpus; put the others in a corpus of their own)")
    if not isinstance(record, dict) or field not in record:
        keys = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else type(record).__name__
        raise MeshrunError(f"{where}: no {field!r} field (it has {keys}) (hint: --text-field NAME; chat data are "
                           "records with 'messages', or with 'prompt' and 'completion')")
    value = record[field]
    if not isinstance(value, str):
        raise MeshrunError(f"{where}: the {field!r} field is {type(value).__name__}, not text "
                           "(hint: --text-field NAME)")
    return value


def _read_text(path: str) -> str:
    text = _decoded(path)
    if isinstance(text, UnicodeDecodeError):
        raise MeshrunError(f"{path}: not UTF-8 text at byte {text.start} (hint: convert it, e.g. iconv -t utf-8)")
    return text


def _decoded(path: str) -> str | UnicodeDecodeError:
    """The file's text, or why it is not UTF-8."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise _gone(path, exc) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc


def _jsonl(path: str, field: str) -> Iterator[str]:
    """Each line's text field."""
    for n, record in jsonl_records(path):
        yield _field(record, field, f"{path}:{n}")


def jsonl_records(path: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed record) of each non-blank line; a line that is not UTF-8 or not JSON
    is a one-line error naming the file and the line's number."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise _gone(path, exc) from None
    with f:
        for n, raw in enumerate(_lines(f, path), 1):
            if len(raw) > MAX_LINE_BYTES:
                raise MeshrunError(f"{path}:{n}: a line of more than {MAX_LINE_BYTES >> 20} MiB, which meshrun "
                                   "reads whole (hint: split the document over several lines, or give it as a "
                                   "text file)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise MeshrunError(f"{path}:{n}: not UTF-8 text at byte {exc.start} of the line "
                                   "(hint: convert it, e.g. iconv -t utf-8)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as exc:
                why = getattr(exc, "msg", "nested too deeply")
                raise MeshrunError(f"{path}:{n}: not a JSON line ({why})") from None
            yield n, record


def chat_records(source: Source) -> Iterator[tuple[str, dict[str, Any]]]:
    """(``path:line``, record) of every record of a chat corpus' files, in order, each checked
    as a record of the corpus' kind (chat.py)."""
    from .chat import check_record

    if source.chat is None:
        raise ValueError("not a chat corpus")
    for path in source.paths:
        for n, record in jsonl_records(path):
            where = f"{path}:{n}"
            yield where, check_record(record, source.chat, where, source.text_field)


def _lines(f: BinaryIO, path: str) -> Iterator[bytes]:
    """The lines of an open file; a read that fails is a one-line error naming it."""
    while True:
        try:
            line = f.readline(MAX_LINE_BYTES + 1)
        except OSError as exc:
            raise _gone(path, exc) from None
        if not line:
            return
        yield line


def _unreadable(path: str, what: str, exc: Exception, hint: str) -> MeshrunError:
    """The one line for an input its library could not read (a cut or damaged file): named as
    the input it is, never as the output being written."""
    why = first_line(str(exc), 200) or type(exc).__name__
    return MeshrunError(f"{path}: cannot read it as {what}: {why} (hint: {hint})")


def _parquet(path: str, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MeshrunError(f"{path}: reading parquet needs pyarrow, not installed here "
                           "(hint: pip install 'meshrun[data]')") from None
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(path)
    except FileNotFoundError as exc:
        raise _gone(path, exc) from None
    except (OSError, pa.ArrowException) as exc:
        raise _unreadable(path, "parquet", exc, "write the file again") from None
    if field not in pf.schema_arrow.names:
        raise MeshrunError(f"{path}: no {field!r} column (it has {', '.join(pf.schema_arrow.names[:8])}) "
                           "(hint: --text-field NAME)")
    kind = pf.schema_arrow.field(field).type
    if str(kind) not in ("string", "large_string", "string_view"):
        raise MeshrunError(f"{path}: the {field!r} column holds {kind}, not text (hint: --text-field NAME of a "
                           "text column)")
    def unreadable(exc: Exception) -> MeshrunError:
        if isinstance(exc, (OSError, pa.ArrowException)):
            return _unreadable(path, "parquet", exc, "write the file again")
        raise exc

    for batch in _batches(pf.iter_batches(columns=[field], batch_size=1024), unreadable):
        yield from batch.column(0).to_pylist()


def _dataset(path: str, field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise MeshrunError(f"{path}: a saved dataset needs the datasets library, not installed here "
                           "(hint: pip install 'meshrun[data]')") from None
    def unreadable(exc: Exception) -> MeshrunError:
        return _unreadable(path, "a saved dataset", exc, "save it again with save_to_disk")

    # Whatever datasets raises while reading the user's directory means it cannot be read: a
    # cut Arrow file (ArrowInvalid), damaged JSON (ValueError), JSON of another shape
    # (AttributeError, KeyError, TypeError)
    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:
        raise unreadable(exc) from None
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else sorted(ds)[0]
        ds = ds[split]
    if field not in ds.column_names:
        raise MeshrunError(f"{path}: no {field!r} column (it has {', '.join(ds.column_names[:8])}) "
                           "(hint: --text-field NAME)")
    kind = getattr(ds.features.get(field), "dtype", None)
    if kind not in ("string", "large_string"):
        raise MeshrunError(f"{path}: the {field!r} column holds {kind or ds.features.get(field)}, not text "
                           "(hint: --text-field NAME of a text column)")
    for batch in _batches(iter(ds.iter(batch_size=1024)), unreadable):
        yield from batch[field]


def _batches(batches: Iterator[Any], unreadable: Callable[[Exception], MeshrunError]) -> Iterator[Any]:
    """Each batch a reader gives; what it raises while reading is ``unreadable``'s one line
    (which may raise the exception again, for one that is not the file's fault). The texts of a
    batch that are None (a null cell) are left to the caller's ``documents``, which skips them."""
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:
            raise unreadable(exc) from None
        if batch is None:
            return
        yield batch


def documents(source: Source, not_utf8: list[str]) -> Iterator[str]:
    """Every non-empty document of the corpus, in order. A file of a directory that is not UTF-8
    text (a source tree holds a few in older encodings: 4 of CPython 3.11's test files) is left
    out and its path added to ``not_utf8``, for the caller to say; a file named alone is an error."""
    for path in source.paths:
        if source.dataset:
            texts: Iterator[str] = _dataset(path, source.text_field)
        elif path.endswith(".jsonl"):
            texts = _jsonl(path, source.text_field)
        elif path.endswith(".parquet"):
            texts = _parquet(path, source.text_field)
        elif source.directory:
            text = _decoded(path)
            if isinstance(text, UnicodeDecodeError):
                not_utf8.append(path)
                continue
            texts = iter([text])
        else:
            texts = iter([_read_text(path)])
        for text in texts:
            if text:
                yield text
