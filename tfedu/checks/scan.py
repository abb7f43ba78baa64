"""Static scan of a student's answer cell, done in the grader's process before anything runs.

Two kinds of problem make an exercise score zero (the answer cell is then replaced by the stub
before the notebook runs, so it cannot disturb the rest of the submission):

- **escape hatches**, for every answer: code that reaches outside plain computation to run code
  the grader cannot see or to tamper with the machinery around it: ``exec``/``eval``/``compile``,
  ``__import__``, ``importlib``, ``sys.modules`` and the other process-level parts of ``sys``,
  ``os.system``/``os._exit``/``os.kill``, ``subprocess``, threads and signals, IPython magics and
  shell escapes (``!cmd``, ``%%bash``, ``get_ipython()``), ``input()``, frame and code-object
  introspection (``__code__``, ``__globals__``, ``f_back``, ``__subclasses__``, ...), defining
  ``__torch_function__``, importing ``tfedu.checks`` or ``tfedu.course.grading``, assigning or
  deleting an attribute of anything but ``self`` (``torch.allclose = ...``, ``j = json; j.dump = ...``,
  ``setattr``, ``__setattr__``: monkeypatching), ``operator.attrgetter``/``methodcaller`` and
  ``getattr`` passed around as a value (computed attribute access in disguise), writing files
  (``open(..., "w")``, ``write_text``, ``savetxt``: a written module could be imported, out of the
  tripwire's sight), loaders that can run code (``pickle``, ``torch.load``, ``timeit``, ``doctest``,
  ``typing.get_type_hints``), private internals of a library (``torch._C``), ``getattr`` with a
  computed name (on ``self`` too), a method taken from its class (``A.m(torch, ...)``: any object
  can stand in for ``self``, whose attributes a method may set), and strings naming introspection
  (``"{0.__globals__}"``).
- **the reference itself**: the exercise's ``Probe.forbidden`` names (``tfedu.softmax`` in the
  softmax exercise), reached through an import, an attribute chain from an imported name, a name
  the notebook bound earlier (``reference_softmax``), ``getattr`` with a constant, or a string
  naming the module or its file.
- **a library's shortcut**: a library function or class outside the exercise's ``Probe.builds``,
  its allow-list of building blocks (:mod:`tfedu.checks.building_blocks`).

Names are followed to what they are (:func:`resolve`), not only read as text: ``torch.serialization.os``
is ``os``, with ``os``'s rules; a function re-exported by another module is still the reference; the
same object under another name is the same object.

The cell is first turned into plain Python with IPython's own input transformer, exactly as the
kernel would, so magics cannot hide from the scan; a cell that does not parse scores zero.

The scan is itself bounded, so an answer cannot turn it against the grader: a cell longer than
:data:`MAX_ANSWER_CHARS` is not scanned at all, and one scan stops at :data:`SCAN_SECONDS`
(checked between IPython's transform steps, which re-tokenise the whole cell for every ``!``/``%``
line, and every few hundred AST nodes). Either way the answer scores zero with the reason and
nothing of it runs. The walk itself is linear: an attribute chain is resolved once, at its
outermost node, not again at each of its links.
A runtime tripwire inside the kernel (see :mod:`tfedu.course.grading.harness`) backs this scan up.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
import threading
import time
import types
from collections.abc import Iterable

from tfedu.checks import building_blocks

# The course's longest answer is about 2,000 characters: ten times that is still an honest answer.
MAX_ANSWER_CHARS = 20_000
# One scan of one answer cell; the course's answers take well under 0.1 s.
SCAN_SECONDS = 5.0
# All the scans of one submission together (each answer is scanned up to three times).
SUBMISSION_SCAN_SECONDS = 20.0
# Reported problems per answer, so a cell of a thousand distinct tricks gives a readable reason.
MAX_PROBLEMS = 10

BANNED_CALLS = {
    "exec": "runs code the grader cannot see",
    "eval": "runs code the grader cannot see",
    "compile": "builds code the grader cannot see",
    "__import__": "imports modules behind the grader's back",
    "globals": "reaches into the notebook's namespace",
    "vars": "reaches into namespaces",
    "locals": "reaches into namespaces",
    "breakpoint": "waits for input that never comes",
    "input": "waits for input that never comes",
    "exit": "stops the notebook",
    "quit": "stops the notebook",
    "get_ipython": "talks to the notebook machinery (magics, shell commands, hooks)",
    "__builtins__": "patches Python's built-ins",
    "__builtin__": "patches Python's built-ins",
    "__loader__": "reaches the import machinery",
    "__spec__": "reaches the import machinery",
}
BANNED_MODULES = {
    "importlib", "builtins", "__builtin__", "inspect", "gc", "ctypes", "cffi", "subprocess", "multiprocessing",
    "concurrent", "threading", "_thread", "signal", "pty", "socket", "marshal", "runpy", "pkgutil", "code",
    "codeop", "IPython", "ipykernel", "jupyter_client", "zmq", "nbformat", "nbclient", "nbconvert", "resource",
    "faulthandler", "atexit", "site", "sysconfig", "asyncio", "sched", "pdb", "bdb", "trace", "tracemalloc",
    "unittest", "pytest", "psutil", "mmap", "fcntl", "posix", "nt", "shutil", "pickle", "dill", "cloudpickle",
    "webbrowser", "urllib", "http", "requests", "selectors", "select", "_posixsubprocess", "dis", "opcode",
    "ast", "tokenize", "linecache", "traceback", "weakref", "copyreg", "sitecustomize", "usercustomize",
    "tfedu.checks", "tfedu.course.grading", "torch.testing", "timeit", "doctest", "cProfile", "profile", "shelve",
    "pickletools", "jinja2", "numexpr", "torch.load", "torch.jit", "torch.package", "torch.hub", "torch.fx",
    "torch.compile", "torch.multiprocessing", "torch.utils.cpp_extension", "torch.library", "typing.get_type_hints",
    "numpy.f2py", "numpy.distutils", "numpy.ctypeslib", "torch.ops", "torch.classes", "pandas.read_pickle", "joblib", "tempfile", "glob", "zipimport", "imp",
    "socketserver", "xmlrpc", "logging", "torch.futures", "torch.distributed", "ipywidgets", "matplotlib.animation",
    "sqlite3", "dbm", "zipfile", "tarfile", "fileinput",
    # attrgetter/methodcaller are getattr with a computed name in disguise
    "operator", "_operator", "io.FileIO", "_io", "torch.utils.collect_env", "torch.utils.benchmark",
}
WRITING_ATTRIBUTES = {"write_text", "write_bytes", "symlink_to", "hardlink_to", "link_to", "chmod", "lchmod", "touch",
                      "savetxt", "tofile", "savez", "savez_compressed", "rmdir", "rmtree", "symlink", "chown", "save",
                      "rename", "memmap", "extractall", "extract", "mkfifo", "truncate", "mkdir", "makedirs",
                      "unlink", "FileIO", "mknod", "removedirs", "utime"}
ALLOWED_ATTRIBUTES = {
    "sys": {"stdout", "stderr", "version", "version_info", "maxsize", "float_info", "int_info", "platform",
            "byteorder", "getsizeof", "float_repr_style", "hexversion", "getrecursionlimit"},
    "os": {"path", "sep", "linesep", "cpu_count", "getcwd", "listdir", "scandir", "environ", "getenv", "fspath",
           "walk", "stat", "PathLike", "devnull", "extsep", "curdir", "pardir"},
    "types": {"SimpleNamespace", "MethodType", "MappingProxyType", "GeneratorType", "NoneType"},
}
BANNED_ATTRIBUTES = {
    "__code__", "__globals__", "__builtins__", "__closure__", "__subclasses__", "__bases__", "__base__", "__mro__",
    "__dict__", "__self__", "__getattribute__", "__import__", "__loader__", "__spec__", "__traceback__",
    "__torch_function__", "__torch_dispatch__", "__reduce__", "__reduce_ex__", "__wrapped__", "__defaults__",
    "__kwdefaults__", "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "f_trace", "tb_frame", "tb_next",
    "gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "co_code", "co_consts",
    "system", "popen", "_exit", "getoutput", "run_line_magic", "run_cell_magic", "set_custom_exc", "excepthook",
    "modules", "meta_path", "path_hooks", "settrace", "setprofile", "_getframe", "monitoring", "addaudithook",
    "__annotations__", "__file__", "__path__", "__cached__", "__func__", "__objclass__", "__signature__",
    "__text_signature__", "__qualname__", "f_lasti", "co_filename", "__setattr__", "__delattr__",
}
BANNED_DEFINITIONS = {"__torch_function__", "__torch_dispatch__", "__getattribute__", "__del__", "__init_subclass__",
                      "__class_getitem__", "__set_name__", "__instancecheck__", "__subclasscheck__"}
PROTECTED_STRINGS = ("tfedu.checks", "tfedu.course.grading", "tfedu/checks", "tfedu/course/grading", "solutions.json")
# names that, written inside a string, point at introspection (str.format, attrgetter, ...)
SUSPECT_IN_STRINGS = tuple(sorted({a for a in BANNED_ATTRIBUTES if a.startswith(("__", "f_", "tb_", "gi_", "co_"))}
                                  | {"__import__", "__builtins__", "exec(", "eval("}))
READ_MODES = {"r", "rb", "rt", "br", "tr"}


class ScanLimitExceeded(Exception):
    """The scan of one answer ran past :data:`SCAN_SECONDS`."""


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise ScanLimitExceeded


def to_python(source: str, deadline: float | None = None) -> str:
    r"""The plain Python the kernel would run for this cell (magics and ``!`` lines included).

    IPython's ``TransformerManager.transform_cell``, with ``deadline`` checked between its token
    transforms: each one re-tokenises the whole cell, so a cell of many escape lines costs
    (lines x size), minutes for 100 kB.

    >>> to_python("!ls")
    "get_ipython().system('ls')\n"
    """
    from IPython.core.inputtransformer2 import TRANSFORM_LOOP_LIMIT, TransformerManager

    manager = TransformerManager()
    lines = (source if source.endswith("\n") else source + "\n").splitlines(keepends=True)
    for transform in manager.cleanup_transforms + manager.line_transforms:
        lines = transform(lines)
    for _ in range(TRANSFORM_LOOP_LIMIT):
        _check_deadline(deadline)
        changed, lines = manager.do_one_token_transform(lines)
        if not changed:
            return "".join(lines)
    raise RuntimeError(f"IPython's input transformation was still changing after {TRANSFORM_LOOP_LIMIT} steps")


# CPython before 3.12 keeps the AST builder's recursion depth in state shared by all threads, so two
# threads building ASTs at once (`tfedu grade --jobs N` scans N submissions at once) can fail one of
# them with "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905): an honest
# answer would score zero as "not valid Python". One lock lets one AST be built at a time, here and wherever
# the grader's process builds one (tfedu.course.grading.needs).
AST_LOCK = threading.Lock()


def parse(source: str, deadline: float | None = None) -> ast.Module:
    python = to_python(source, deadline)
    with AST_LOCK:
        return compile(python, "<answer>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)


def import_aliases(sources: Iterable[str]) -> dict[str, str]:
    """Names bound by imports in ``sources`` -> the dotted name they stand for (best effort)."""
    aliases: dict[str, str] = {}
    for source in sources:
        aliases.update(_aliases_of(source))
    return aliases


@functools.lru_cache(maxsize=512)
def _aliases_of(source: str) -> tuple[tuple[str, str], ...]:
    """The imports of one cell. Cached: every answer is scanned with all the cells before it as context,
    and these (the instructor's cells and answers that already passed the scan) repeat."""
    try:
        tree = parse(source)
    except Exception:
        return ()
    return tuple(_aliases_in(tree).items())


def _aliases_in(tree: ast.AST) -> dict[str, str]:
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if alias.name != "*":
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _classes_in(tree: ast.AST) -> dict[str, tuple[str, ...]]:
    """The classes a cell defines -> the names of their methods that take ``self``."""
    classes: dict[str, tuple[str, ...]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            classes[node.name] = tuple(m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                                       and m.args.args and m.args.args[0].arg == "self")
    return classes


@functools.lru_cache(maxsize=512)
def _classes_of(source: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    try:
        return tuple(_classes_in(parse(source)).items())
    except Exception:
        return ()


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name the cell binds itself (these shadow names bound by the notebook before it)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` (or ``getattr(a, "b")``) as ``["a", "b", "c"]``; None when the root is not a name."""
    parts: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            parts.append(node.args[1].value)
            node = node.args[0]
        elif isinstance(node, ast.Name):
            parts.append(node.id)
            return parts[::-1]
        else:
            return None


# Packages whose modules the scan may import to follow a name: the course's own reference library (its
# modules have no side effects on import). Anything else is followed only through modules already loaded.
IMPORTABLE = ("tfedu",)
NOT_IMPORTED = ("tfedu.checks", "tfedu.course")


def _module(name: str):
    module = sys.modules.get(name)
    if module is None and name.split(".")[0] in IMPORTABLE and not name.startswith(NOT_IMPORTED):
        try:
            module = importlib.import_module(name)
        except Exception:  # not a module (a function's dotted name), or a broken one: not followed
            return None
    return module


@functools.lru_cache(maxsize=4096)
def _follow(dotted: str) -> tuple[str, object] | None:
    """``(walked, obj)`` for :func:`resolve`; ``obj`` is None where the walk stopped short of the end."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module(".".join(parts[:cut]))
        if module is not None:
            break
    else:
        return None
    obj, owner, rest = module, module.__name__, []
    for k, attr in enumerate(parts[cut:]):
        if not isinstance(obj, (types.ModuleType, type)):  # an instance: its attributes are its own business
            rest += parts[cut + k:]
            obj = None
            break
        try:
            obj = inspect.getattr_static(obj, attr)
        except AttributeError:
            rest += parts[cut + k:]
            obj = None
            break
        if isinstance(obj, types.ModuleType):
            owner, rest = obj.__name__, []
        else:
            rest.append(attr)
    return ".".join([owner, *rest]), obj


def resolve(dotted: str) -> tuple[str, str] | None:
    """Where a dotted name really leads, followed through the objects it names as the kernel would find them.

    Returns ``(walked, defined)``: ``walked`` is the name through the last *module* reached
    (``torch.serialization.os.fork`` is ``os.fork``, ``os.path.join`` is ``posixpath.join``) and
    ``defined`` the module and qualified name of the function or class at the end, where it was
    defined (a function re-exported by another module is still its defining module's); "" when
    unknown. None when the name does not start with a loaded module. Nothing is called on the way:
    attributes are read statically (no properties, no module ``__getattr__``), and no module is
    imported except the course's own reference modules (:data:`IMPORTABLE`).

    >>> resolve("os.path.join")
    ('posixpath.join', 'posixpath.join')
    """
    found = _follow(dotted)
    if found is None:
        return None
    walked, obj = found
    target = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    module_name, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    defined = f"{module_name}.{qualname}" if isinstance(module_name, str) and isinstance(qualname, str) and callable(target) else ""
    return walked, defined


def _matches(dotted: str, names: Iterable[str]) -> str | None:
    for name in names:
        if dotted == name or dotted.startswith(name + "."):
            return name
    return None


def scan_answer(source: str, *, context: Iterable[str] = (), forbidden: Iterable[str] = (),
                allowed: frozenset[str] | None = None, time_limit: float = SCAN_SECONDS) -> list[str]:
    """Problems with one answer cell, as sentences a student can act on; empty when clean.

    ``context`` holds the sources of the cells that run before it (to know what names such as
    ``F`` or ``reference_softmax`` stand for); ``forbidden`` the exercise's ``Probe.forbidden``;
    ``allowed`` its ``Probe.builds``, the only library functions and classes it may use
    (:mod:`tfedu.checks.building_blocks`; None: any).
    A cell over :data:`MAX_ANSWER_CHARS`, or whose scan runs past ``time_limit`` seconds, has
    one problem saying so.

    >>> scan_answer("x = 1" + " " * MAX_ANSWER_CHARS)
    ['the answer cell is 20,005 characters, over the limit of 20,000; nothing was run']
    """
    if len(source) > MAX_ANSWER_CHARS:
        return [f"the answer cell is {len(source):,} characters, over the limit of {MAX_ANSWER_CHARS:,}; nothing was run"]
    try:
        return _scan(source, tuple(context), tuple(forbidden), allowed, time.monotonic() + time_limit)
    except ScanLimitExceeded:
        return [f"the static scan of the answer cell ran past its limit of {time_limit:g} s (too many IPython "
                f"`!`/`%` lines, or code nested too deep?); nothing was run"]


def _scan(source: str, context: tuple[str, ...], forbidden: tuple[str, ...], allowed: frozenset[str] | None,
          deadline: float) -> list[str]:
    try:
        tree = parse(source, deadline)
    except ScanLimitExceeded:
        raise
    except Exception as err:  # SyntaxError, but also RecursionError/MemoryError on absurdly nested code
        return [f"the answer cell is not valid Python ({type(err).__name__}: {str(err)[:200]}); it was not run"]
    _check_deadline(deadline)
    bound = _bound_names(tree)
    aliases = {k: v for k, v in import_aliases(context).items() if k not in bound}
    aliases.update(_aliases_in(tree))
    problems: dict[str, None] = {}  # an ordered set: `in` on a list made many distinct problems quadratic

    def flag(message: str) -> None:
        problems.setdefault(message if len(message) <= 500 else message[:500] + "...")

    reported: set[str] = set()
    outside: dict[str, str] = {}  # library names outside the exercise's building blocks -> where first found
    forbidden_objects = [(name, found[1]) for name in forbidden if (found := _follow(name)) is not None
                         and found[1] is not None and not isinstance(found[1], types.ModuleType)]

    def reference_used(hit: str, how: str) -> None:
        if hit not in reported:
            reported.add(hit)
            flag(f"this exercise asks you to build it yourself, but the answer uses `{hit}` (what this exercise rebuilds) "
                 f"through {how}; an answer that uses the reference scores zero")

    def check_name(dotted: str, how: str) -> None:
        hit = _matches(dotted, forbidden)
        if hit:
            reference_used(hit, how)
        banned = _matches(dotted, [m for m in BANNED_MODULES if "." in m or m == dotted.split(".")[0]])
        if banned:
            flag(f"answers may not use `{banned}` (found {how})")
        parts = dotted.split(".")
        if parts[0] in ALLOWED_ATTRIBUTES and len(parts) > 1 and parts[1] not in ALLOWED_ATTRIBUTES[parts[0]]:
            flag(f"answers may not use `{parts[0]}.{parts[1]}` (found {how})")

    def check_allowed(dotted: str, how: str, found: tuple[str, object] | None) -> None:
        """A library function or class outside the exercise's building blocks (``allowed``)."""
        assert allowed is not None
        if found is None or found[1] is None:  # not loaded, or past a lazy attribute (librosa.filters): by its name
            name = dotted if found is None else found[0]
            is_leaf = not any(a.startswith(name + ".") for a in allowed)
        else:
            name, obj = found
            is_leaf = callable(obj) and not isinstance(obj, types.ModuleType)
        if is_leaf and building_blocks.library_of(name) and name not in allowed:
            outside.setdefault(name, f"{how}, which is `{name}`" if name != dotted else how)

    def check_dotted(dotted: str, how: str) -> None:
        check_name(dotted, how)
        parts = dotted.split(".")
        private = next((p for p in parts[1:] if p.startswith("_") and not (p.startswith("__") and p.endswith("__"))), None)
        if private:
            flag(f"answers may not use private internals of a library (`{dotted}`)")
        # What the name is, not only what it says: a module reached through another (`torch.serialization.os`
        # is `os`), the reference re-exported by another module, the same object under another name.
        found = _follow(dotted)
        if allowed is not None:
            check_allowed(dotted, how, found)
        if found is None:
            return
        walked, obj = found
        if walked != dotted:
            check_name(walked, f"{how}, which is `{walked}`")
        defined = resolve(dotted)[1]
        hit = _matches(defined, forbidden) if defined else None
        if hit:
            reference_used(hit, f"{how}, which is `{defined}`")
        elif obj is not None and not isinstance(obj, types.ModuleType):
            for name, target in forbidden_objects:
                if obj is target:
                    reference_used(name, f"{how}, which is the same object as `{name}`")

    # `self` is trusted only where it is a method's own first parameter: inside a function defined
    # directly in a class body. Anywhere else (`def f(self)` at the top, `self = os`) it is just a name.
    # (A lambda in a class body, `shape = property(lambda self: ...)`, is a method too.)
    in_methods: set[int] = set()
    first_params: set[int] = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        methods = [m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        methods += [n for stmt in cls.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    for n in ast.walk(stmt) if isinstance(n, ast.Lambda)]
        for method in methods:
            if method.args.args:
                first_params.add(id(method.args.args[0]))
                if method.args.args[0].arg == "self":
                    in_methods.update(id(n) for n in ast.walk(method))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "self" and isinstance(node.ctx, (ast.Store, ast.Del)):
            flag("answers may not assign to the name `self` (it is trusted as a method's own object)")
        elif isinstance(node, ast.arg) and node.arg == "self" and id(node) not in first_params:
            flag("`self` may only be the first parameter of a method defined in a class")
    # A method reached through its class (`A.m`, `type(x).m`, `x.__class__.m`) can be called with any object
    # as `self`, and a method may set and read attributes of `self`: `A.m(torch, ...)` would monkeypatch torch.
    # Only `Base.m(self, ...)` inside a method (a base class's method on the method's own object) is allowed.
    classes = dict(_classes_in(tree))
    for source in context:
        classes.update(_classes_of(source))
    method_names = {m for methods in classes.values() for m in methods}
    self_calls = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call) and id(node) in in_methods
                  and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in method_names):
            continue
        owner = node.value
        through_class = (isinstance(owner, ast.Name) and owner.id in classes
                         or isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "type"
                         or isinstance(owner, ast.Attribute) and owner.attr == "__class__")
        if through_class and id(node) not in self_calls:
            shown = ast.unparse(node)
            flag(f"answers may not take a method from its class (`{shown if len(shown) <= 80 else '...' + shown[-77:]}`): "
                 "called that way any object can stand in for `self`; call it on an instance, or as "
                 "`Base.method(self, ...)` inside a method")
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    # Links inside a longer chain (`a.b` in `a.b.c`, `a` in `getattr(a, "b")`): the chain is checked
    # once at its outermost node, where every prefix is seen, instead of once per link (quadratic).
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    inner |= {id(node.args[0]) for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "getattr" and len(node.args) >= 2}
    for count, node in enumerate(ast.walk(tree)):
        if count % 256 == 0:
            _check_deadline(deadline)
        if isinstance(node, ast.Name) and node.id in ("getattr", "setattr", "delattr") and id(node) not in called:
            flag(f"answers may only call `{node.id}` directly (passing it around hides which attribute it reaches)")
        if isinstance(node, ast.Import):
            for alias in node.names:
                check_dotted(alias.name, f"`import {alias.name}`")
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            for alias in node.names:
                check_dotted(module if alias.name == "*" else f"{module}.{alias.name}", f"`from {module} import {alias.name}`")
            check_dotted(module, f"`from {module} import ...`")
        elif isinstance(node, ast.Name) and node.id in BANNED_CALLS:
            flag(f"answers may not use `{node.id}` (it {BANNED_CALLS[node.id]})")
        elif isinstance(node, ast.Attribute) and node.attr in BANNED_ATTRIBUTES:
            flag(f"answers may not use `.{node.attr}` (it reaches into the interpreter or the notebook machinery)")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in BANNED_DEFINITIONS:
            flag(f"answers may not define `{node.name}` (it changes how other code sees your objects)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            text = node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
            for name in (*forbidden, *PROTECTED_STRINGS):
                if name in text or name.replace(".", "/") in text:
                    flag(f"the answer contains a string naming `{name}`, which an answer may not use")
            for name in SUSPECT_IN_STRINGS:
                if name in text:
                    flag(f"the answer contains a string naming `{name.rstrip('(')}` (introspection through a string)")
        elif isinstance(node, ast.Attribute) and node.attr in WRITING_ATTRIBUTES:
            flag(f"answers may not write or change files (`.{node.attr}`)")
        elif isinstance(node, ast.Call) and (isinstance(node.func, ast.Name) and node.func.id == "open"
                                             or isinstance(node.func, ast.Attribute) and node.func.attr == "open"):
            # open(path, mode) and Path(...).open(mode), gzip.open(path, mode), ...: reading only
            if isinstance(node.func, ast.Name):
                mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            else:  # the mode's position differs (Path.open(mode), gzip.open(path, mode)): look at every argument
                modes = [a for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                         and 0 < len(a.value) <= 3 and set(a.value) <= set("rwabxt+") and set(a.value) & set("wax+")]
                mode = modes[0] if modes else next((k.value for k in node.keywords if k.arg == "mode"), None)
            unknown = any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args)
            if unknown or mode is not None and not (isinstance(mode, ast.Constant) and mode.value in READ_MODES):
                flag("answers may not write files (`open` with a mode other than reading)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr", "getattr", "hasattr"):
            target = _chain(node.args[0]) if node.args else None
            name = node.args[1] if len(node.args) >= 2 else None
            constant = isinstance(name, ast.Constant) and isinstance(name.value, str)
            if node.func.id in ("setattr", "delattr") and target and target[0] in aliases:
                flag(f"answers may not change attributes of `{'.'.join(target)}` (monkeypatching a library)")
            if constant and (name.value in BANNED_ATTRIBUTES or name.value in WRITING_ATTRIBUTES):
                flag(f"answers may not use `.{name.value}` (it reaches into the interpreter or the notebook machinery)")
            if not constant:
                flag(f"answers may not use `{node.func.id}` with a computed attribute name (name the attribute, or keep "
                     "the objects in a dict or an `nn.ModuleList`)")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                        chain = _chain(sub)
                        # Only an object's own attributes may be set (self.x = ...): any other
                        # attribute store may be a module reached through a plain name
                        # (`j = json; j.dump = fake`), which no alias tracking can rule out.
                        if not (chain and chain[0] == "self" and id(sub) in in_methods):
                            shown = ".".join(chain) if chain else f"....{sub.attr}"
                            flag(f"answers may only set attributes of `self`, not `{shown}` (that would be monkeypatching a library)")
                        if sub.attr == "__class__":
                            flag("answers may not reassign `__class__`")
        if isinstance(node, (ast.Attribute, ast.Name, ast.Call)) and id(node) not in inner:
            chain = _chain(node)
            if chain and chain[0] in aliases:
                shown = ".".join(chain)
                check_dotted(".".join([aliases[chain[0]], *chain[1:]]), f"`{shown if len(shown) <= 200 else shown[:200] + '...'}`")
    for name, how in outside.items():
        if not any(other.startswith(name + ".") for other in outside):  # not the module of a name flagged already
            flag(f"this exercise is built from elementary operations ({building_blocks.GROUP_WORDS}); `{name}` (found "
                 f"{how}) is not one of them, and an answer that uses it scores zero")
    found = list(problems)
    if len(found) > MAX_PROBLEMS:
        found = found[:MAX_PROBLEMS] + [f"and {len(found) - MAX_PROBLEMS} more problems"]
    return found
