"""Which cells of a notebook grading needs: the exercises, their checks and what those use, not the demos.

A graded run executes every answer cell, every check cell and its hidden test, and each earlier cell
of the notebook that binds or may change a name those read, transitively; it skips the rest
(demonstrations, plots, long experiments). The analysis reads the cells themselves (Python's ``ast``
after IPython's own transformation of magics), so it cannot drift from the notebook.

What counts as a cell *touching* a name ``x`` (so that the cell runs when ``x`` is needed later):

- binding it: ``x = ...``, ``for x in``, ``def x``, ``import x``, ``del x``, ``x += ...``;
- changing it in place: ``x.a = ...``, ``x[i] = ...``, a method call ``x.fit()`` or ``x.a.b.step()``, passing
  it to a call ``train(x)``, ``f(x.weight)`` (the callee may change it);
- calling a function of the notebook whose body does one of those to the global ``x``.

Names bound by an ``import`` are libraries: calls on them (``torch.manual_seed(0)``) and passing them are
not counted as changes (an assignment to one of their attributes is). A cell that cannot be read this way
(unparsable, a cell magic, a line magic such as ``%time`` that hides code in a string, ``from m
import *``) always runs, and one that reads names dynamically
(``globals()``, ``eval``, ``exec``, ``__main__``) runs with every cell before it. An answer that reads
names dynamically makes the whole notebook run (:func:`dynamic`): its needs cannot be known.
"""

from __future__ import annotations

import ast
import builtins
import functools
import symtable
from dataclasses import dataclass, field
from typing import Any

from tfedu.checks.scan import AST_LOCK

DYNAMIC_NAMES = frozenset({"globals", "vars", "locals", "eval", "exec", "__main__", "get_ipython", "__import__",
                           "__builtins__", "breakpoint"})
# In a trusted cell IPython's magics become get_ipython() calls; those read no notebook name.
TRUSTED_DYNAMIC_NAMES = DYNAMIC_NAMES - {"get_ipython"}
DYNAMIC_ATTRIBUTES = frozenset({"__dict__", "__globals__", "modules", "f_globals", "f_locals", "user_ns"})
# Line magics that run no code of the notebook; any other magic makes its cell opaque.
PLAIN_MAGICS = frozenset({"pip", "conda", "matplotlib", "load_ext", "reload_ext", "config", "autoreload", "precision",
                          "xmode", "pwd", "ls", "who", "whos"})
# Builtins that only read what they are given (passing a name to them changes nothing).
READ_ONLY_CALLS = frozenset({"print", "display", "len", "isinstance", "issubclass", "type", "repr", "str", "callable",
                             "hasattr", "id", "format"})


@dataclass
class Cell:
    """What one cell binds or changes (``touches``) and reads (``reads``), and how it must be treated."""

    touches: set[str] = field(default_factory=set)
    reads: set[str] = field(default_factory=set)
    opaque: bool = False  # cannot be analysed: always runs
    dynamic: bool = False  # reads names dynamically: every cell before it runs


@functools.lru_cache(maxsize=1)
def _transformer() -> Any:
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager()


def python_source(source: str) -> str | None:
    """The cell as plain Python (IPython's magics and shell escapes turned into calls); None if unreadable."""
    try:
        return _transformer().transform_cell(source)
    except Exception:
        return None


def _base(node: ast.AST) -> str | None:
    """The name at the root of ``x``, ``x.a.b``, ``x[i].a``, ``x.f().g`` (None for a literal or a call of a call)."""
    while True:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            return None


class _Scope(ast.NodeVisitor):
    """Walks the statements that run when the cell runs (not function bodies): what they touch."""

    def __init__(self, libraries: set[str], functions: dict[str, set[str]]):
        self.libraries, self.functions = libraries, functions
        self.touched: set[str] = set()
        self.imported: set[str] = set()
        self.star = False

    def changed(self, node: ast.AST) -> None:
        name = _base(node)
        if name is not None and name not in self.libraries:
            self.touched.add(name)

    # Bindings.
    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.touched.add(node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            name = _base(node)
            if name is not None:
                self.touched.add(name)  # an attribute of a library set here is a change too
        self.generic_visit(node)

    visit_Subscript = visit_Attribute  # type: ignore[assignment]

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            name = alias.asname or alias.name.split(".")[0]
            self.touched.add(name)
            self.imported.add(name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name == "*":
                self.star = True
            else:
                self.touched.add(alias.asname or alias.name)
                self.imported.add(alias.asname or alias.name)

    def _define(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.touched.add(node.name)
        for decorator in node.decorator_list:
            self.visit(decorator)
        if not isinstance(node, ast.ClassDef):
            for default in [*node.args.defaults, *node.args.kw_defaults]:
                if default is not None:
                    self.visit(default)
            self.functions[node.name] = _function_touches(node, self.libraries | self.imported, self.functions)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _define  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> None:
        pass  # its body runs when called

    # Changes in place.
    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            self.changed(func.value)
        elif isinstance(func, ast.Name) and func.id in self.functions:
            self.touched |= self.functions[func.id]
        if not (isinstance(func, ast.Name) and func.id in READ_ONLY_CALLS):
            for argument in [*node.args, *(k.value for k in node.keywords)]:
                self.changed(argument)
        self.generic_visit(node)


def _function_touches(node: ast.FunctionDef | ast.AsyncFunctionDef, libraries: set[str],
                      functions: dict[str, set[str]]) -> set[str]:
    """The global names a call of the function ``node`` may bind or change."""
    arguments = node.args
    local = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}
    local |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
    declared: set[str] = set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.Global, ast.Nonlocal)):
            declared.update(inner.names)
    scope = _Scope(libraries, functions)
    for statement in node.body:
        scope.visit(statement)
    assigned = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}
    local |= assigned - declared
    return (scope.touched - local - scope.imported) | (declared & assigned)


class _Reads(ast.NodeVisitor):
    """The names the cell's own statements read before binding them (in order, as they run). Bodies of
    functions, lambdas, classes and comprehensions are left to :func:`_scope_reads`."""

    def __init__(self) -> None:
        self.bound: set[str] = set()
        self.reads: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            if node.id not in self.bound:
                self.reads.add(node.id)
        else:
            self.bound.add(node.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name) and node.target.id not in self.bound:
            self.reads.add(node.target.id)
        self.visit(node.value)
        self.visit(node.target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.visit(node.iter)
        self.visit(node.target)
        for statement in [*node.body, *node.orelse]:
            self.visit(statement)

    visit_AsyncFor = visit_For  # type: ignore[assignment]

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:
            self.bound.add(alias.asname or alias.name.split(".")[0])

    visit_ImportFrom = visit_Import  # type: ignore[assignment]

    def _define(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        if isinstance(node, ast.ClassDef):
            for base in [*node.bases, *(k.value for k in node.keywords)]:
                self.visit(base)
        else:
            for default in [*node.args.defaults, *node.args.kw_defaults]:
                if default is not None:
                    self.visit(default)
        self.bound.add(node.name)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _define  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp) -> None:
        self.visit(node.generators[0].iter)  # evaluated in the cell's scope; the rest in the comprehension's

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension  # type: ignore[assignment]


def _scope_reads(table: symtable.SymbolTable) -> set[str]:
    """The global names read inside the functions, lambdas, classes and comprehensions of a cell."""
    reads: set[str] = set()
    for child in table.get_children():
        reads |= {s.get_name() for s in child.get_symbols() if s.is_referenced() and s.is_global()}
        reads |= _scope_reads(child)
    return reads


def _plain_magic(call: ast.Call) -> bool:
    """Whether an IPython magic call runs no Python code of the notebook (``%pip``, ``%matplotlib``, ...):
    ``%time x = f(y)`` or a cell magic hides code in a string the analysis cannot read."""
    return (isinstance(call.func, ast.Attribute) and call.func.attr == "run_line_magic" and bool(call.args)
            and isinstance(call.args[0], ast.Constant) and call.args[0].value in PLAIN_MAGICS)


def _globals_lookups(tree: ast.AST) -> tuple[set[str], int]:
    """The names read as ``globals().get("name")`` or ``globals()["name"]``, and how many such lookups."""
    def is_globals(node: ast.AST) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "globals"
                and not node.args and not node.keywords)

    names, count = set(), 0
    for node in ast.walk(tree):
        key = None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and is_globals(node.func.value) and node.args):
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_globals(node.value):
            key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            names.add(key.value)
            count += 1
    return names, count


def analyse(source: str, libraries: set[str], functions: dict[str, set[str]], *, trusted: bool = True) -> Cell:
    """What ``source`` touches and reads. ``libraries`` (names bound by imports so far) and ``functions``
    (the notebook's functions and what a call of each touches) are updated with what the cell adds."""
    python = python_source(source)
    try:
        with AST_LOCK:  # one AST at a time in this process (CPython gh-106905; see tfedu.checks.scan)
            tree = ast.parse(python) if python is not None else None
            table = symtable.symtable(python, "<cell>", "exec") if python is not None else None
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        tree = table = None
    if tree is None or table is None:
        return Cell(opaque=trusted)  # an answer that does not parse raises SyntaxError and reads nothing
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    looked_up, lookups = _globals_lookups(tree)
    if lookups == sum(isinstance(n, ast.Name) and n.id == "globals" for n in ast.walk(tree)):
        names.discard("globals")  # only globals().get("name") and globals()["name"]: plain reads of those names
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    order = _Reads()
    scope = _Scope(libraries, functions)
    try:
        for statement in tree.body:
            order.visit(statement)
            scope.visit(statement)
        reads_inside = _scope_reads(table)
    except RecursionError:  # nested past what the visitors follow: always run a trusted cell, a whole notebook for an answer
        return Cell(opaque=trusted, dynamic=not trusted)
    libraries |= scope.imported
    dynamic_names = TRUSTED_DYNAMIC_NAMES if trusted else DYNAMIC_NAMES
    dynamic = bool(names & dynamic_names) or (not trusted and bool(attributes & DYNAMIC_ATTRIBUTES))
    magic = trusted and any(not _plain_magic(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
                            and isinstance(node.func, ast.Attribute) and node.func.attr in ("run_line_magic", "run_cell_magic"))
    reads = order.reads | (reads_inside - order.bound) | looked_up
    return Cell(scope.touched, reads - set(dir(builtins)), opaque=scope.star or magic, dynamic=dynamic)


def needed(cells: list[tuple[str, bool, bool]]) -> set[int]:
    """The indices of the cells a graded run must execute.

    ``cells`` is the notebook in order, as ``(source, required, trusted)``: a required cell always runs
    (an answer, a check, a hidden test); an untrusted one (an answer) that does not parse reads nothing
    (it raises SyntaxError). The result holds every required cell, every opaque cell, and every earlier
    cell that touches a name a kept cell reads, transitively; a kept dynamic cell keeps every cell before it.
    """
    libraries: set[str] = set()
    functions: dict[str, set[str]] = {}
    analysed = [analyse(source, libraries, functions, trusted=trusted) for source, _, trusted in cells]
    keep: set[int] = set()
    wanted: set[str] = set()
    everything_before = -1  # every cell before this index runs (a dynamic cell was kept)
    for index in range(len(cells) - 1, -1, -1):
        cell, required = analysed[index], cells[index][1]
        if required or cell.opaque or index < everything_before or cell.touches & wanted:
            keep.add(index)
            wanted |= cell.reads
            if cell.dynamic:
                everything_before = max(everything_before, index)
    return keep


def dynamic(source: str) -> bool:
    """Whether a learner's answer reads the notebook's names in a way the analysis cannot follow
    (``globals()``, ``eval``, ``exec``, ``__main__``, ``sys.modules``, ``f.__globals__``, ...)."""
    return analyse(source, set(), {}, trusted=False).dynamic
