"""The learner's parts, carried from notebook to notebook (issue 38, item 3).

When an exercise's check passes on something the learner wrote in a notebook cell, :func:`keep` copies its
definition into a readable module of the learner's own, ``my_tfedu/nbNN.py`` beside the notebook (a
section per exercise; a later pass replaces it). A later notebook's *switch cell* asks for it::

    MultiHeadAttention = tfedu.use_mine("5.3", tfa.MultiHeadAttention)

and gets the learner's class when the file has it and it still passes its check, in a fresh kernel, or the
reference with the reason printed when it does not. Nothing is lost by a crash: the file is written when
the check passes, atomically.

Where the folder is: ``my_tfedu/`` in the kernel's working folder (Jupyter starts a notebook's kernel in the
notebook's folder), or the folder named by ``TFEDU_MY_PARTS``; ``TFEDU_MY_PARTS=off`` switches keeping and
using off (the grader does: a graded notebook stands alone, earlier notebooks' parts are the reference stand-ins).
In Colab, whose files vanish with the session, ``tfedu.keep_parts_on_drive()`` in a notebook's first cell
keeps the folder on the learner's Google Drive.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import datetime
import importlib
import importlib.util
import inspect
import io
import linecache
import os
import pkgutil
import re
import sys
import types
from pathlib import Path
from typing import Any, NamedTuple

ENV = "TFEDU_MY_PARTS"
FOLDER = "my_tfedu"
DRIVE_FOLDER = "/content/drive/MyDrive/tfedu/my_tfedu"
HEADER = '''"""Your parts from notebook {notebook}: what you wrote for its exercises, kept by tfedu when their checks passed.

Each section is one exercise, as you last passed it. Later notebooks use them through
`tfedu.use_mine("N.M", reference)`; edit them here if you like (a part that no longer passes its
check is replaced by the reference, with the reason).
"""

import math

import einops
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

KEPT: dict[str, str] = {{}}  # exercise number -> the name of the part
'''
HEADER_NAMES = {"math", "einops", "np", "torch", "F", "nn", "KEPT"}
SECTION = re.compile(r"^# ---- exercise (?P<number>\S+) .*?(?=^# ---- exercise |\Z)", re.M | re.S)

_folder: list[Path] = []  # set by keep_parts_on_drive or use_folder for this interpreter
_carried: dict[int, str] = {}  # id of a part handed out by use_mine -> its exercise number


def switched_off() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("off", "0", "no", "false")


def folder() -> Path:
    """Where the learner's parts are kept."""
    if _folder:
        return _folder[-1]
    named = os.environ.get(ENV, "").strip()
    return Path(named).expanduser() if named and not switched_off() else Path.cwd() / FOLDER


def use_folder(path: str | Path) -> Path:
    """Keep and look for the learner's parts in ``path`` for the rest of this session."""
    _folder.append(Path(path).expanduser())
    return _folder[-1]


def keep_parts_on_drive(path: str = DRIVE_FOLDER) -> Path:
    """In Colab: mount Google Drive and keep the learner's parts there, so later notebooks find them."""
    if "google.colab" not in sys.modules:
        raise RuntimeError("keep_parts_on_drive() is for Colab; elsewhere your parts are kept in "
                           f"{Path.cwd() / FOLDER} (or where {ENV} says)")
    from google.colab import drive  # type: ignore[import-not-found]

    drive.mount("/content/drive")
    Path(path).mkdir(parents=True, exist_ok=True)
    print(f"your parts are kept in {path} on your Google Drive")
    return use_folder(path)


def file_for(number: str) -> Path:
    return folder() / f"nb{int(number.split('.')[0]):02d}.py"


# ----------------------------------------------------------------------------- the exercises, by number

class Exercise(NamedTuple):
    number: str  # "5.2", as its header gives it
    grade_id: str  # its solution cell's, "ex_masked_attention"
    module: str  # its checker module, "tfedu.checks.nb05_masks_and_heads"
    hints: Any  # its tfedu.checks.core.Hints, which names its checker


def number_order(number: str) -> tuple[int, int, str]:
    """Sort key of an exercise number: "5.10" after "5.9", "5.3a" after "5.3"."""
    major, minor, suffix = re.fullmatch(r"(\d+)\.(\d+)(\D*)", number).groups()
    return int(major), int(minor), suffix


def exercises() -> dict[str, Exercise]:
    """Every exercise with hints, by number, read from the checker modules' ``HINTS`` (imported by name:
    they import this module's users)."""
    import tfedu.checks

    found: dict[str, Exercise] = {}
    for info in pkgutil.iter_modules(tfedu.checks.__path__):
        if re.fullmatch(r"nb\d\d_\w+", info.name):
            module = importlib.import_module(f"tfedu.checks.{info.name}")
            for grade_id, hints in getattr(module, "HINTS", {}).items():
                found[hints.number] = Exercise(hints.number, grade_id, module.__name__, hints)
    return found


def checker_for(number: str) -> Any:
    """The checker function of exercise ``number``, or None."""
    entry = exercises().get(str(number))
    return getattr(sys.modules[entry.module], entry.hints.check, None) if entry else None


# ----------------------------------------------------------------------------- keeping a part when its check passes

def cell_source(obj: Any) -> tuple[str, str] | None:
    """(the source of the notebook cell that defined ``obj``, or of its definition in a script run as
    ``__main__``; its name there), or None when the learner did not write it so (a reference, a lambda in a
    test, a part loaded from a file, code run with exec)."""
    functions = [obj] if inspect.isfunction(obj) else [f for f in vars(obj).values() if inspect.isfunction(f)] \
        if inspect.isclass(obj) else []
    name = getattr(obj, "__name__", None)
    if not functions or name is None or name == "<lambda>" or getattr(obj, "__module__", None) != "__main__":
        return None
    filename = functions[0].__code__.co_filename
    if re.search(r"ipykernel_\d+|<ipython-input-", filename):  # a notebook cell: IPython keeps its source
        lines = linecache.getlines(filename)
        return ("".join(lines), name) if lines else None
    try:  # a script run as __main__: the definition itself, read from its file
        return inspect.getsource(obj), name
    except (OSError, TypeError):
        return None


def definitions(source: str) -> str:
    """The cell's imports, functions, classes and plain constant assignments; nothing it runs."""
    tree = ast.parse(source)
    keep = []
    for node in tree.body:
        constant = (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and all(isinstance(t, ast.Name) for t in node.targets))
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or constant:
            start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            keep.append("\n".join(source.splitlines()[start - 1:node.end_lineno]))
    return "\n\n\n".join(keep)


def free_names(code: str) -> list[str]:
    """Names the code reads but neither defines nor imports (nor Python's builtins)."""
    tree = ast.parse(code)
    bound = set(HEADER_NAMES) | set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    loaded = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    return sorted({n for n in loaded if n not in bound})


def bring(name: str, namespace: dict[str, Any], kept_here: set[str]) -> str:
    """One line that gives ``name`` in the learner's file what it is in the notebook, or a comment saying why not."""
    if name in kept_here:
        return ""  # another section of the same file defines it
    if name not in namespace:
        return f"# {name}: not defined in your notebook when this was kept"
    value = namespace[name]
    if id(value) in _carried:
        return f"{name} = _use_mine({_carried[id(value)]!r})  # your part, carried from its own notebook"
    if isinstance(value, types.ModuleType):
        return f"import {value.__name__} as {name}"
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module and qualname and module != "__main__" and "<locals>" not in qualname and "." not in qualname:
        return f"from {module} import {qualname} as {name}"
    if isinstance(value, (bool, int, float, str, type(None))):
        return f"{name} = {value!r}"
    return f"# {name}: defined in your notebook, not carried (it is not the answer to an exercise)"


def keep(number: str, check: str, obj: Any, namespace: dict[str, Any] | None = None) -> Path | None:
    """Keep ``obj``, which just passed exercise ``number``'s check, in the learner's file; the file, or None."""
    if switched_off():
        return None
    found = cell_source(obj)
    if found is None:
        if getattr(obj, "__module__", None) == "__main__" and (inspect.isfunction(obj) or inspect.isclass(obj)) \
                and getattr(obj, "__name__", "") != "<lambda>":
            print(f"   (not kept for later notebooks: tfedu keeps what you write in a notebook cell or a script "
                  f"file, and could not find the source of {obj.__name__})")
        return None
    source, name = found
    try:
        code = definitions(source)
    except SyntaxError:
        return None
    namespace = namespace if namespace is not None else vars(sys.modules["__main__"])
    path = file_for(number)
    text = path.read_text(encoding="utf-8") if path.is_file() else HEADER.format(notebook=path.stem[2:])
    sections = {m["number"]: m.group(0).rstrip() + "\n" for m in SECTION.finditer(text)}
    head = SECTION.split(text)[0] if sections else text
    others = "".join(body for n, body in sections.items() if n != number)
    kept_here = set(re.findall(r"^(?:def|class) (\w+)", others, re.M))
    brought = [line for line in (bring(n, namespace, kept_here) for n in free_names(code)) if line]
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    sections[number] = "\n".join([f"# ---- exercise {number} ({name}), kept {when}, when {check} passed",
                                  *brought, "", code, "", f"KEPT[{number!r}] = {name!r}", ""]) + "\n"
    ordered = sorted(sections.items(), key=lambda item: number_order(item[0]))
    if any("_use_mine(" in body for _, body in ordered) and "_use_mine" not in head:
        head = head.rstrip("\n") + "\n\nfrom tfedu import use_mine as _use_mine\n"
    text = head.rstrip("\n") + "\n\n\n" + "\n\n".join(body for _, body in ordered)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".py.partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)  # atomic: a crash leaves the old file or the new one, never half of one
    return path


# ----------------------------------------------------------------------------- using a part in a later notebook

def load(path: Path, number: str) -> Any:
    """The part kept for exercise ``number`` in the learner's file ``path`` (imported afresh)."""
    spec = importlib.util.spec_from_file_location(f"my_tfedu_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kept = getattr(module, "KEPT", {})
    if number not in kept:
        raise LookupError(f"{path} has no part for exercise {number}")
    return getattr(module, kept[number])


def use_mine(number: str, reference: Any, *, name: str | None = None, quiet: bool = False) -> Any:
    """The learner's part for exercise ``number`` if it is kept and still passes its check; else ``reference``
    (None where the reference is tfedu's own model, not a function of the same shape).

    Prints one line saying which, and why when it is the reference.
    """
    number = str(number)
    known = exercises().get(number)
    name = name or getattr(reference, "__name__", None) or (known.grade_id.removeprefix("ex_") if known else "the part")

    def say(text: str) -> None:
        if not quiet:
            print(f"exercise {number} {name}: {text}")

    if switched_off():
        say(f"the reference ({ENV} is off here: a graded run uses the reference for other notebooks' parts)")
        return reference
    path = file_for(number)
    if not path.is_file():
        say(f"the reference ({path} does not exist: pass exercise {number}'s check in its notebook to keep yours)")
        return reference
    try:
        part = load(path, number)
    except Exception as err:  # the learner's file: any error is a reason, never a traceback
        say(f"the reference (your {path.name} does not load: {type(err).__name__}: {err})")
        return reference
    check = checker_for(number)
    if check is None:
        say(f"the reference (exercise {number} has no checker to confirm your part)")
        return reference
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the check's tick line is not the learner's business here
            check(part)
    except AssertionError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        say(f"the reference (yours in {path.name} no longer passes its check: {first})")
        return reference
    _carried[id(part)] = number
    say(f"yours, from {path}")
    return part


# ----------------------------------------------------------------------------- parts inside tfedu's models

def with_block_function(model: Any, block_fn: Any) -> Any:
    """A copy of a tfedu model whose pre-norm blocks each compute ``block_fn(resid, ln1, attn, ln2, mlp)``
    (exercise 7.4's function) with their own sub-layers, weights and hook points; ``model`` is unchanged.

    Notebook 07 writes this swap out by hand (``MyBlock``); later notebooks take it from here.
    """
    import copy

    model = copy.deepcopy(model)
    for block in model.blocks:
        if block.norm_position != "pre" or block.has_cross_attention or not block.cfg.has_mlp:
            raise ValueError("with_block_function needs pre-norm decoder blocks with an MLP (exercise 7.4's wiring)")
        block.forward = types.MethodType(_block_forward(block_fn), block)
    return model


def _block_forward(block_fn: Any) -> Any:
    def forward(self: Any, resid: Any, mask: Any = None, *, causal: bool = False, positions: Any = None,
                attn_bias: Any = None, context: Any = None, context_mask: Any = None, kv_cache: Any = None) -> Any:
        if context is not None:
            raise ValueError("this block has no cross-attention")

        def attn(x: Any) -> Any:
            return self.hook_attn_out(self.attn(x, mask=mask, causal=causal, positions=positions, bias=attn_bias,
                                                kv_cache=kv_cache))

        return self.hook_resid_post(block_fn(self.hook_resid_pre(resid), self.ln1, attn, self.ln2, self.mlp))

    return forward
