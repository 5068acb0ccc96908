"""The codebase's own rules, checked on its source: imports point one way between layers and
never form a cycle (imports inside functions counted too), command modules stand alone, and
comments and docstrings say what the code does, not when or in which round of work it
became so, nor point outside the repository."""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
PACKAGE = os.path.join(SRC, "meshrun")

# Highest first: a module may import its own package and the layers below it, never a layer
# above; the packages of the launch layer do not import each other; the shared names at the
# bottom import nothing above them (and no cycle among them, like everywhere).
LAYERS = (
    ("meshrun.__main__",),
    ("meshrun.start",),
    ("meshrun.cli",),
    ("meshrun.doctor",),
    ("meshrun.job",),
    ("meshrun.training",),
    ("meshrun.config",),
    ("meshrun.data",),
    ("meshrun.plan",),
    ("meshrun.kernels",),
    ("meshrun.modelinfo",),
    ("meshrun.integrations",),
    ("meshrun.launch", "meshrun.render", "meshrun.api"),
    ("meshrun.cluster",),
    ("meshrun.errors", "meshrun.vocab", "meshrun.defaults", "meshrun.units", "meshrun"),
)
SHARED = len(LAYERS) - 1


def _modules() -> dict[str, str]:
    """module name -> file, for every module of the package (a package by its __init__)."""
    out = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), SRC)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(dirpath, name)
    return out


MODULES = _modules()


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _imports(module: str) -> list[tuple[str, bool, bool]]:
    """(imported meshrun module, imported inside a function, imported for annotations only under
    ``if TYPE_CHECKING:``) for every import statement."""
    path = MODULES[module]
    tree = ast.parse(open(path).read(), path)
    typing_only = _type_checking_only(tree)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[:len(parts) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:  # `from pkg import module` imports that module
                full = f"{base}.{alias.name}"
                targets.append(full if full in MODULES else base)
        for target in targets:
            if target == "meshrun" or target.startswith("meshrun."):
                while target not in MODULES:  # an attribute path: the module that holds it
                    target = target.rpartition(".")[0]
                out.append((target, id(node) in in_function, id(node) in typing_only))
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _layer(module: str) -> tuple[int, str]:
    """(layer index, the layer's package) of a module: the longest package prefix listed."""
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (i, name)
    assert best is not None, module
    return best


def test_the_check_sees_imports_inside_functions():
    inside = sum(1 for edges in GRAPH.values() for _, local, _ in edges if local)
    assert inside > 20, inside  # the trainer's CLI imports torch-side modules only when it runs
    assert ("meshrun.training.parallel.dims", True, False) in GRAPH["meshrun.job"]  # job.check, for --tp/--pp/--cp


def test_the_check_sees_imports_for_annotations_only():
    typed = {(m, t) for m, edges in GRAPH.items() for t, _, typing_only in edges if typing_only}
    assert ("meshrun", "meshrun.training.trainer") in typed  # meshrun's lazy names, typed for the type checker


def test_no_import_cycle_between_meshrun_modules():
    """Imports for annotations only count too: a cycle hidden behind ``if TYPE_CHECKING:`` is
    still two modules that each need the other to be read."""
    edges = {m: sorted({t for t, _, _ in GRAPH[m] if t != m}) for m in GRAPH}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_imports_point_down_the_layers():
    """cli -> doctor -> train -> plan -> modelinfo -> integrations -> launch, render, api ->
    cluster -> the shared names (errors, vocab, defaults, units). Imports for annotations only
    are left out: meshrun's own __init__ names the public classes of every layer for the type
    checker, and imports them only when asked (its ``__getattr__``)."""
    wrong = []
    for module, edges in GRAPH.items():
        mine, my_pkg = _layer(module)
        for target, _, typing_only in edges:
            if typing_only:
                continue
            theirs, their_pkg = _layer(target)
            if theirs < mine or (theirs == mine and their_pkg != my_pkg and mine != SHARED):
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


def test_command_modules_import_no_other_command_nor_the_cli_package():
    commands = [m for m in MODULES if m.startswith("meshrun.cli.") and m != "meshrun.cli.options"]
    assert len(commands) >= 7
    wrong = [f"{m} imports {t}" for m in commands for t, _, _ in GRAPH[m]
             if t == "meshrun.cli" or (t.startswith("meshrun.cli.") and t != "meshrun.cli.options")]
    assert not wrong, wrong


# ---- comments and docstrings --------------------------------------------------------------

# Words that date a line instead of explaining it: an ordinal naming a round of work, a lettered
# run ("call BO"), an issue number, the documents' numbers ("seed 002"), and paths outside the
# repository.
HISTORY = [
    (re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
                r"thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth)\s+"
                r"(session|round|call|pass|iteration|attempt)s?\b", re.I), "an ordinal round of work"),
    (re.compile(r"\b(session|round)\s+\d+\b", re.I), "a numbered round of work"),
    (re.compile(r"\bcalls?\s+[A-Z]{1,2}\b(?:\s*[,/-]\s*[A-Z]{1,2}\b)*"), "a lettered call"),
    (re.compile(r"\bissue[\s-]*#?\d+", re.I), "an issue number"),
    (re.compile(r"(?<![\w/])#\d{2,}\b"), "an issue number"),
    (re.compile(r"\bseeds?\s+0\d\d\b", re.I), "a document's number"),
    (re.compile(r"\b(the documents'|the documents (describe|prescribe|report|name)|seeds'|the seed guide|slides)(?!\w)",
                re.I), "an unnamed source"),
    (re.compile(r"\.\./(shared|\.library)\b|/work/|\.\./\.\./"), "a path outside the repository"),
]
CHECKED = [os.path.join(dp, f) for top in ("src", "tests", "bench", "examples", "docs")
           for dp, _, fs in os.walk(os.path.join(ROOT, top)) for f in fs
           if f.endswith((".py", ".sh", ".md")) and "__pycache__" not in dp] + [os.path.join(ROOT, "README.md")]


def _history(text: str) -> list[str]:
    return [why for pattern, why in HISTORY if pattern.search(text)]


@pytest.mark.parametrize("line,why", [
    ("# Measured in the sixteenth session on 4 x H200", "an ordinal round of work"),
    ("# (calls BO-BT) the defaults", "a lettered call"),
    ("# see call AZ", "a lettered call"),
    ("# fixed for issue 5", "an issue number"),
    ("# as seed 002 does", "a document's number"),
    ("# the documents' toy model", "an unnamed source"),
    ("the PyTorch Distributed slides' script", "an unnamed source"),
    ("# from ../shared/BASELINE.md", "a path outside the repository"),
])
def test_the_history_check_catches_each_kind(line, why):
    assert why in _history(line)


@pytest.mark.parametrize("line", [
    "# the first step pays for compilation", "# a second rank", "# the call returns the loss",
    "torch 2.11 on an H200: 28% MFU eager", "# pytorch#126670, fused AdamW under FSDP2",
])
def test_the_history_check_lets_plain_text_through(line):
    assert _history(line) == [], line


def _comments_and_docstrings(path: str) -> list[tuple[int, str]]:
    """(line, text) of a Python file's comments and docstrings; every line of other files."""
    text = open(path, encoding="utf-8").read()
    if not path.endswith(".py"):
        return list(enumerate(text.splitlines(), 1))
    out = [(i, line[line.index("#"):]) for i, line in enumerate(text.splitlines(), 1)
           if "#" in line and not line.lstrip().startswith(("'", '"'))]
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                first = node.body[0].lineno
                out += [(first + k, line) for k, line in enumerate(doc.splitlines())]
    return out


def test_comments_and_docstrings_carry_no_history():
    """Comments and docstrings in src/, tests/, bench/ and examples/, and docs/ and the README,
    say what the code does now and why, and name their sources; a measurement names its number,
    card and torch version, not the round of work that took it (docs/decisions.md keeps the
    measurements)."""
    found = []
    for path in CHECKED:
        if path == os.path.abspath(__file__):
            continue  # this file's own patterns and examples
        for lineno, text in _comments_and_docstrings(path):
            for why in _history(text):
                found.append(f"{os.path.relpath(path, ROOT)}:{lineno}: {why}: {text.strip()[:100]}")
    assert not found, "\n".join(found[:60]) + f"\n({len(found)} in all)"


def test_the_ci_script_names_only_files_that_exist():
    """A path .ci/run names (a test file, a helper) is one the repository has."""
    text = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    named = set(re.findall(r"(?<![\w$/.-])((?:tests|src|bench|docs|examples|\.ci)/[\w./-]*\w)", text))
    assert named, "the pattern finds the paths .ci/run names"
    missing = sorted(p for p in named if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, missing


def _docstring_ids(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and its functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                out.add(id(first.value))
    return out


def test_strategy_rules_come_from_the_table():
    """The trainer and the planner read what a strategy does from vocab's table (its kinds'
    attributes and the named roles there), never by comparing or spelling out a strategy's name:
    no string constant in meshrun.training, meshrun.config, meshrun.job or meshrun.plan is one of
    vocab.STRATEGIES' names."""
    from meshrun.vocab import STRATEGIES

    found = []
    for module, path in sorted(MODULES.items()):
        if not module.startswith(("meshrun.training", "meshrun.config", "meshrun.job", "meshrun.plan")):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
        docs = _docstring_ids(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in STRATEGIES
                    and id(node) not in docs):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, "\n".join(found)


def test_importing_the_cli_changes_no_process_state():
    """The CLI's package sets no signal handler as it is imported, also for `meshrun train`
    (whose preemption signals the console script holds before the import: start.py)."""
    import subprocess
    import sys

    code = ("import signal, sys; sys.argv = ['meshrun', 'train']; sigs = (signal.SIGTERM, signal.SIGUSR1, "
            "signal.SIGINT); before = [signal.getsignal(s) for s in sigs]; import meshrun.cli; "
            "sys.exit(0 if [signal.getsignal(s) for s in sigs] == before else 1)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# ---- who sets an object's attributes ------------------------------------------------------

# Objects a module may set attributes of although it neither is them nor made them: module ->
# (the assignments' targets as written, why).
FOREIGN_WRITES_ALLOWED: dict[str, tuple[set[str], str]] = {
    "meshrun.data.prepare": ({"exc.filename"}, "names the token file on the OSError it caught and raises again"),
    "meshrun.launch.node": ({"report.inner"}, "chains torchrun's failure report in front of the rendezvous "
                            "filter the job builds"),
    "meshrun.training.snapshot.reader": ({"metadata.storage_meta.load_id"},
                                        "DCP's metadata gets the load id FileSystemReader records"),
    "meshrun.training.snapshot.deepspeed": ({"engine.checkpoint_engine"}, "DeepSpeed's engine reads through "
                                           "meshrun's verified reader for one load, put back after"),
    "meshrun.training.models.gpt": ({"self.head.weight"}, "ties the model's output head to its token embedding"),
    "meshrun.training.parallel.tp": ({"block.qkv", "block.n_heads", "model.head.weight"}, "tensor parallelism "
                                  "splits meshrun GPT's attention over the ranks and ties the head to the sharded "
                                  "embedding again"),
    "meshrun.training.models.masks": ({"model.config._attn_implementation"}, "selects the attention kernel of a "
                                   "Hugging Face model: its config attribute is transformers' switch"),
    "meshrun.training.parallel.context": ({"model.config._attn_implementation", "block.attend", "model.positions"},
                                       "context parallelism rewires the model's attention and positions to the "
                                       "sharded sequence"),
    "meshrun.plan.trace": ({"config._attn_implementation"}, "a model the trainer runs in FlexAttention is "
                           "traced on an attention entry that saves what FlexAttention saves, put back after"),
    "meshrun.kernels.hf": ({"model.forward"}, "a Hugging Face model Liger does not know takes its training loss "
                           "with meshrun's head loss: its forward is replaced on the instance"),
    "meshrun.plan.trace_liger": ({"twin.config._attn_implementation", "f.apply"},
                                           "the traced meta twin gets the model's attention kernel; Liger's "
                                           "autograd Functions get stand-ins while tracing, put back after"),
    "meshrun.training.parallel.apply": ({"m.stats_group"}, "gives the model's expert layers the group their load "
                                     "balancing reduces over"),
    "meshrun.training.parallel.ddp": ({"ddp.released_old_buckets"}, "marks the DDP wrapper the layout built once "
                                   "its first gradient buckets are freed"),
    "meshrun.training.parallel.float8": ({"m.fused_mlp"}, "turns off the fused MLP of blocks whose linear layers "
                                      "became float8 (it reads their weights directly)"),
    "meshrun.training.quantize": ({"module.weight", "module.bias"}, "a LoRA run's frozen linear layers get "
                                  "their weights back in bf16, as Parameters that stay frozen"),
    "meshrun.training.parallel.layouts": ({"self.optimizer.found_inf"}, "the fused AdamW skips a non-finite step "
                                       "on the device when found_inf is set: torch's interface for it"),
}


def _assigned(node: ast.AST) -> list[ast.expr]:
    """The targets an assignment statement binds, tuples unpacked."""
    if isinstance(node, ast.Assign):
        pending = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        pending = [node.target]
    else:
        return []
    out: list[ast.expr] = []
    while pending:
        t = pending.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            pending += t.elts
        elif isinstance(t, ast.Starred):
            pending.append(t.value)
        else:
            out.append(t)
    return out


def _made_by_call(fn: ast.AST) -> set[str]:
    """Names a function binds to what a call returns (``x = f()``, ``a, b = f(), g()``,
    ``with f() as x``): objects it made itself."""
    names: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            pairs: list[tuple[ast.expr, ast.expr]] = []
            for t in _assigned(node) if isinstance(node, ast.AnnAssign) else node.targets:
                if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(t.elts) == len(
                        node.value.elts):
                    pairs += zip(t.elts, node.value.elts)
                else:
                    pairs.append((t, node.value))
            for t, v in pairs:
                if isinstance(v, ast.Call):  # (``ns, extra = parser.parse_known_args()``: both made)
                    names |= {n.id for n in _assigned(ast.Assign([t], v)) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
            names.add(node.optional_vars.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not fn:
            names.add(node.name)  # a function it defines
    return names


def _library_names(tree: ast.Module) -> set[str]:
    """Names the module binds by importing a library (not meshrun): a write through one of
    them patches that library (a rank's sys.stdout, torch's autocast queries while tracing)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).partition(".")[0] for a in node.names if not a.name.startswith("meshrun")}
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("meshrun"):
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(expr: ast.expr) -> str | None:
    """The name an attribute or subscript chain starts from (``sys`` of ``sys.modules[k].x``)."""
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _own_typed_params(fn: ast.FunctionDef | ast.AsyncFunctionDef, classes: set[str]) -> set[str]:
    """Parameters annotated with a class the module defines (its own type's objects), or with
    argparse's Namespace (a command's parsed arguments: a record the command line fills in)."""
    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    return {a.arg for a in args if a.annotation is not None
            and ast.unparse(a.annotation).strip("'\"").removesuffix(" | None") in classes | {"argparse.Namespace"}}


def _foreign_writes(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, target) of every ``x.attr = ...`` (or ``+=``, or within a tuple target) where
    ``x`` is not ``self``/``cls``, nor an object the function or one around it made by a call,
    nor a parameter of a type the module defines, nor torch's autograd context (``ctx``), nor a
    tensor's gradient slot (``.grad``), nor a library the module imports (a patch of it)."""
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    libraries = _library_names(tree)
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, own: frozenset[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                autograd = {a.arg for a in child.args.args} & {"ctx"}  # a Function's forward and backward
                visit(child, own | _made_by_call(child) | _own_typed_params(child, classes) | autograd)
                continue
            for t in _assigned(child):
                if not isinstance(t, ast.Attribute) or t.attr == "grad":
                    continue
                if isinstance(t.value, ast.Name) and t.value.id in {"self", "cls"} | own:
                    continue
                if _root(t) in libraries - own:
                    continue
                found.append((child.lineno, ast.unparse(t)))
            visit(child, own)

    visit(tree, frozenset())
    return found


def test_the_foreign_write_check_catches_each_form():
    tree = ast.parse("def f(trainer, layout: Layout):\n    trainer.step = 1\n    trainer.a, b = 1, 2\n"
                     "    trainer.accum += 1\n    self.layout.accum = 2\n    layout.accum = 3\n"
                     "    made = g()\n    made.x = 1\n"
                     "    def hook():\n        made.y = 2\n        trainer.z = 3\n"
                     "class Layout:\n    def m(self):\n        self.a = 1\n")
    assert [t for _, t in _foreign_writes(tree)] == [
        "trainer.step", "trainer.a", "trainer.accum", "self.layout.accum", "trainer.z"]


def test_no_module_sets_attributes_of_objects_it_does_not_own():
    """A module sets attributes of ``self``, of objects it made, and of its own types' objects;
    another object's state is changed by that object's methods, or by returning the new values
    for it to apply (the Trainer applies what the batch fit and a resume found). Writes that
    are the way a library is used (patching a module for one rank, rewiring a model's modules
    to parallelize it) are listed in FOREIGN_WRITES_ALLOWED with their reason."""
    found = []
    for module, path in sorted(MODULES.items()):
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for line, target in _foreign_writes(tree):
            if target not in FOREIGN_WRITES_ALLOWED.get(module, (set(), ""))[0]:
                found.append(f"{os.path.relpath(path, ROOT)}:{line}: {target} (in {module})")
    assert not found, "\n".join(found)
    stale = [f"{module}: {target}" for module, (targets, _) in FOREIGN_WRITES_ALLOWED.items() for target in targets
             if target not in {t for _, t in _foreign_writes(ast.parse(open(MODULES[module]).read()))}]
    assert not stale, stale  # an entry for a write that is gone goes too
