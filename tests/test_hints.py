"""Every hint is a command that works: a refusal whose hint names a flag and a value is run
again with that value, and it must not be refused for the same reason.

The refusals are those of tests/test_bad_input.py (each one fails during validation, before
any process starts) and a few more whose hints name values, all run in-process. A suggestion is
``--flag VALUE`` (or ``--flag=VALUE``, ``--flag A or B``, ``--flag A/B``: each value is tried)
or ``drop --flag``; a placeholder (``--experts E``, ``an --ep that divides 3``) is no command
and is left out. The rerun passes when it is accepted, or refused for another reason."""

from __future__ import annotations

import contextlib
import io
import re

from helpers import clean_env
from test_bad_input import CASES, COMMAND_PREFIXES, SCRIPT, TOPOLOGY_BAD, _fill, make_dirs

from meshrun.cli import main

GPU80 = ("--gpu-mem", "80GiB")

# Refusals test_bad_input.py does not hold whose hints name a value.
MORE: list[list[str]] = [
    ["train", "--dry-run", "--precision", "bf16"],
    ["train", "--dry-run", "--precision", "fp8"],
    ["train", "--dry-run", "--precision", "fp8-rowwise"],
    ["train", "--dry-run", "--strategy", "single", "--nproc", "2"],
    ["train", "--dry-run", "--fused-loss", "--tp", "2", "--nproc", "2"],
    ["train", "--dry-run", "--tp", "2", "--nproc", "2", "--seq-len", "33", "--sequence-parallel", "on"],
    ["train", "--dry-run", "--cp", "2", "--tp", "2", "--nproc", "4"],
    ["train", "--dry-run", "--compile", "off", "--compile-tune"],
    ["render", "slurm", "--nodes", "1", "--max-restarts=-1", "--", "echo"],
    ["render", "hostfile", "--nodes", "2"],
    ["render", "slurm", "--nodes", "1", "--sbatch-arg", "--a b", "--", "echo"],
]

# Words that follow a flag in a sentence but are not its value.
NOT_VALUES = {"a", "an", "and", "or", "of", "to", "for", "with", "in", "it", "that", "which", "sets", "moves",
              "writes", "less", "more", "than", "off?", "the", "is", "are", "yet", "e.g."}
# Words after which a flag starts a command ("use --nproc 1", "or --strategy ddp"); a flag at the
# start or after punctuation does too.
COMMAND_WORDS = {"use", "or", "add", "pass", "try", "with", "give", "set"}
VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:,+-]*")
FLAG = re.compile(r"(?:(\w+)\s+)?--([a-z][a-z0-9-]*)(?:=(\S+)|\s+((?:(?!\s--)[^;()])*))?")


def _is_value(word: str) -> bool:
    """A literal value, not a word of the sentence nor a placeholder (SIZE, NAME, E, CLAIM:PATH)."""
    letters = re.sub(r"[^A-Za-z]", "", word)
    return bool(VALUE.fullmatch(word)) and word.lower() not in NOT_VALUES and not (letters and letters.isupper())


def suggestions(hint: str) -> list[tuple[str, str, str | None]]:
    """(action, flag, value) for each command the hint names: ("set", "--precision", "fp32"),
    ("drop", "--fused-loss", None)."""
    found: list[tuple[str, str, str | None]] = []
    clauses = re.split(r",\s|;\s", hint)  # "--nproc 1, or ..."; "--hosts a,b" is one value
    for m in (m for clause in clauses for m in FLAG.finditer(clause)):
        before, flag, joined, rest = m.group(1), "--" + m.group(2), m.group(3), m.group(4)
        if before == "drop":
            found.append(("drop", flag, None))
            continue
        if before is not None and before not in COMMAND_WORDS:  # a flag named in the sentence: "under --tp"
            continue
        if joined is not None:
            value = joined.rstrip(".),;")
            if _is_value(value) or value.startswith("--"):
                found.append(("set", flag, value))
            continue
        words = (rest or "").split()
        values: list[str] = []
        while words and all(_is_value(v) for v in words[0].rstrip(".").split("/")):
            values += words.pop(0).rstrip(".").split("/")
            if len(words) >= 2 and words[0] == "or" and _is_value(words[1].rstrip(".")):
                words.pop(0)
                continue
            break
        found += [("set", flag, v) for v in values]
    return found


def _run(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv, env)
    lines = [line for line in err.getvalue().splitlines() if line.startswith("meshrun: error: ")]
    return code, lines[-1] if lines else ""


def _takes_value(command: str, flag: str) -> bool:
    from meshrun.cli import command_parser, make_parser

    parser = command_parser(make_parser(command), command)
    return any(flag in a.option_strings and a.nargs != 0 for a in parser._actions)


def _applied(argv: list[str], action: str, flag: str, value: str | None) -> list[str]:
    """``argv`` with the flag dropped, or set to ``value`` (before a ``--`` that ends meshrun's options)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = _takes_value(argv[0], flag)
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    if action == "drop":
        return out
    end = out.index("--") if "--" in out else next((i for i, a in enumerate(out) if a == SCRIPT), len(out))
    return out[:end] + [f"{flag}={value}"] + out[end:]


def _reason(line: str) -> str:
    """The problem an error line states, its numbers left out: ``--nproc=5000: more than 4
    processes per core (hint: ...)`` -> ``more than # processes per core``."""
    problem = line.removeprefix("meshrun: error: ").split(" (hint: ")[0]
    problem = problem.split(": ", 1)[-1]
    return re.sub(r"\d[\d,.]*", "#", problem)


def test_the_hint_reader_takes_commands_and_leaves_out_placeholders():
    assert suggestions("use --nproc 1, or --strategy ddp/fsdp") == [
        ("set", "--nproc", "1"), ("set", "--strategy", "ddp"), ("set", "--strategy", "fsdp")]
    assert suggestions("--precision auto or fp32") == [("set", "--precision", "auto"), ("set", "--precision", "fp32")]
    assert suggestions("drop --fused-loss: under --tp each rank") == [("drop", "--fused-loss", None)]
    assert suggestions("e.g. --sbatch-arg=--exclusive or --sbatch-arg=--mail-type=END") == [
        ("set", "--sbatch-arg", "--exclusive"), ("set", "--sbatch-arg", "--mail-type=END")]
    assert suggestions("--n 45894 or less") == [("set", "--n", "45894")]
    for placeholder in ("--experts E with meshrun's GPT", "an --ep that divides 3", "--gpu-mem SIZE to decide",
                        "a smaller --global-batch or --seq-len", "see --precision in --help", "--text-field NAME"):
        assert suggestions(placeholder) == [], placeholder


def test_every_suggested_value_is_not_refused_again_for_the_same_reason(tmp_path, monkeypatch):
    fix, _ = make_dirs(tmp_path, monkeypatch)
    cases = [(prefix + argv + ([SCRIPT] if name == "launch" else []), env)
             for name, prefix in COMMAND_PREFIXES.items() for argv, env, _ in TOPOLOGY_BAD]
    cases += [(argv, env) for argv, env, _ in CASES] + [(argv, {}) for argv in MORE]
    tried, wrong = [], []
    for argv, env in cases:
        argv = _fill(argv, fix)
        environ = clean_env(**{k: v.replace("{fix}", fix) for k, v in env.items()})
        code, line = _run(argv, environ)
        hint = re.search(r"\(hint: (.*)\)$", line)
        if code != 2 or hint is None:
            continue
        for action, flag, value in suggestions(hint.group(1)):
            again = _applied(argv, action, flag, value)
            if argv[0] == "bench":  # bench runs the benchmark when accepted: its options alone decide
                again = _bench_checked(again, environ)
            code2, line2 = _run(again, environ) if again else (0, "")
            tried.append((argv, again))
            if code2 and _reason(line2) == _reason(line):
                wrong.append(f"{' '.join(argv)}\n  {line}\n  {' '.join(again)}\n  {line2}")
    assert len(tried) >= 12, tried  # the reader still finds the hints that name values
    assert not wrong, "\n".join(wrong)


def _bench_checked(argv: list[str], env: dict[str, str]) -> list[str]:
    """[] when ``meshrun bench`` would accept ``argv``'s options (it would then run), else ``argv``."""
    from meshrun.cli import bench, command_parser, make_parser
    from meshrun.cli.options import fill_env_defaults
    from meshrun.errors import MeshrunError

    parser = make_parser("bench")
    ns = parser.parse_args(argv)
    fill_env_defaults(ns, env, command_parser(parser, "bench")._actions)
    try:
        bench.options(ns, gpu=False)
    except MeshrunError:
        return argv
    return []
