"""The machinery every exercise checker uses.

A checker takes the learner's object, runs it on small seeded inputs, looks for the
known mistakes first (so the hint names the mistake rather than a tensor diff), then
compares with the tfedu reference. It prints one line with a tick on success and raises
``AssertionError`` with a hint on failure, never a raw traceback from deep inside.

A typical checker::

    @checker("stable softmax")
    def check_softmax(softmax):
        x = seeded_randn(0, 4, 7)
        got = call_learner(softmax, x, name="softmax")
        compare(got, reference(x), what="softmax(x)",
                mistakes={"you took the softmax over dim 0; use the last dim": torch.softmax(x, 0)})
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tfedu.checks import carry
from tfedu.checks.building_blocks import ELEMENTARY

TICK = "\N{CHECK MARK}"


class CheckFailure(AssertionError):
    """A check failed; the message is a hint the learner can act on.

    In IPython (Jupyter) the traceback shows the learner's cell and the hint, and none of the
    checker's own frames: those set ``__tracebackhide__ = True`` in their locals. IPython skips
    such frames itself, except the last one, where the error was raised (IPython 8.12,
    ``ultratb``: ``i != lastrecord``); for a checker that is always the ``run`` wrapper made by
    :func:`checker`, so :meth:`_render_traceback_` cuts it. Outside IPython (pytest, a script)
    the error is an ordinary ``AssertionError`` with the same hint (pytest hides the frame too).
    """

    def _render_traceback_(self) -> list[str]:
        """IPython's own traceback for this failure, hidden frames left out (IPython calls this)."""
        try:
            from IPython import get_ipython

            shell = get_ipython()
            lines = shell.InteractiveTB.structured_traceback(type(self), self, without_hidden_tail(self.__traceback__))
            return list(lines)
        except Exception:  # never lose the hint because formatting failed
            return [f"{type(self).__name__}: {self}"]


def without_hidden_tail(tb: TracebackType | None) -> TracebackType | None:
    """The traceback ``tb`` cut before its trailing run of frames that set ``__tracebackhide__``.

    IPython already skips hidden frames in the middle of a traceback (its own ``run_code`` frame
    among them), so only the tail, which it always shows, needs cutting here.
    """
    kept = []
    while tb is not None:
        kept.append(tb)
        tb = tb.tb_next
    while kept and kept[-1].tb_frame.f_locals.get("__tracebackhide__", False):
        kept.pop()
    rebuilt = None
    for entry in reversed(kept):
        rebuilt = TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FRAME_FILE = re.compile(r'^\s*File "?(.+?)"?(?::\d+|, line \d+)', re.MULTILINE)


def traceback_files(shown: str) -> list[str]:
    """The files whose frames a rendered traceback shows, in order (colours ignored).

    Reads the frame headers, IPython's ``File ~/x/core.py:53, in f(...)`` and Python's
    ``File "x/core.py", line 53, in f``, and nothing else: the source lines a traceback quotes
    (IPython 9 shows lines after the failing one too) may mention any file name.
    """
    return _FRAME_FILE.findall(_ANSI.sub("", shown))


class ExerciseNotDone(CheckFailure):
    """The learner's object still raises NotImplementedError."""


NOT_DONE_MESSAGE = "this exercise is not done yet: replace the `raise NotImplementedError` with your code"


BLANK = "____"  # a blank in a hint's skeleton, for the learner to fill


@dataclass(frozen=True)
class Hints:
    """Three hints for one exercise, shown one at a time by ``tfedu.hint("N.M")``, each more detailed.

    Every checker module keeps a ``HINTS`` dict, the exercise's solution-cell grade_id -> ``Hints``.
    None of the three may hold a line of the solution (tests/test_no_answer_on_the_page.py reads them
    as the checker's messages): the skeleton leaves every line that carries the idea with a
    :data:`BLANK` in it.
    """

    number: str  # the exercise's number, "5.2", as its header gives it
    check: str  # the name of the checker the exercise's check cell calls ("check_masked_attention")
    idea: str  # 1: the idea in words: what the result is, which invariant it keeps
    approach: str  # 2: the approach and the shapes: the steps in order, each tensor's shape
    skeleton: str  # 3: the code's outline with blanks (BLANK) where the answer goes


# The checkers run in this interpreter, by "module:function" name (a pass or a failure): a learner has tried
# an exercise once its checker ran, and only then does ``tfedu.solution`` show its reference solution.
ATTEMPTED: set[str] = set()


def exercise_of(module: str, function: str) -> str | None:
    """The number of the exercise whose check is ``module.function``, from the module's ``HINTS``; or None."""
    import sys

    hints = getattr(sys.modules.get(module), "HINTS", {})
    return next((h.number for h in hints.values() if h.check == function), None)


def hint_invitation(module: str, function: str) -> str:
    """The line a failure ends with: how to ask for the exercise's first (or next) hint; "" when it has none."""
    number = exercise_of(module, function)
    return f"\n(stuck? tfedu.hint(\"{number}\") gives a hint; ask again for the next)" if number else ""


def keep_passed(module: str, function: str, args: tuple[Any, ...]) -> None:
    """After a pass: keep the learner's part in their own module (tfedu.checks.carry); never fails the check."""
    number = exercise_of(module, function)
    if number is None or not args:
        return
    try:
        path = carry.keep(number, function, args[0])
    except Exception as err:  # keeping is a convenience: say so, and let the pass stand
        print(f"(your part for {number} could not be kept in {carry.folder()}: {type(err).__name__}: {err})")
        return
    if path is not None:
        print(f"   kept in {path}, for later notebooks")


def checker(title: str) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Turn a function that raises on the first problem into a learner-facing checker.

    Success prints ``✔ <title>: all checks passed``. A ``CheckFailure`` propagates with its
    hint (and no chained traceback); any other exception raised inside the checker itself
    is reported as a failure that quotes it.
    """

    def decorate(body: Callable[..., Any]) -> Callable[..., None]:
        @functools.wraps(body)
        def run(*args: Any, **kwargs: Any) -> None:
            __tracebackhide__ = True  # the learner sees their cell and the hint, not this wrapper
            ATTEMPTED.add(f"{body.__module__}:{body.__name__}")
            try:
                body(*args, **kwargs)
            except CheckFailure as failure:
                invite = hint_invitation(body.__module__, body.__name__)
                raise type(failure)(f"{title}: {failure}{invite}") from None
            except NotImplementedError:
                raise ExerciseNotDone(f"{title}: {NOT_DONE_MESSAGE}{hint_invitation(body.__module__, body.__name__)}") from None
            except Exception as err:  # a bug the checker did not foresee: still a hint, not a traceback
                raise CheckFailure(f"{title}: checking failed with {type(err).__name__}: {err}") from None
            print(f"{TICK} {title}: all checks passed")
            keep_passed(body.__module__, body.__name__, args)

        run.title = title  # type: ignore[attr-defined]
        return run

    return decorate


def upstream_problem(check: Callable[[Any], Any], learner_fn: Any, *, not_done: str, wrong: str) -> str | None:
    """The hint for an earlier exercise that an answer calls, when that one fails its own ``check``; else None.

    Used where an exercise builds on the learner's answer to an earlier one (4.2 on 4.1, 6.4 on 6.3):
    ``not_done`` when the earlier answer is unfinished, ``wrong`` followed by its check's hint when it is wrong.
    """
    try:
        check(learner_fn)
    except ExerciseNotDone:
        return not_done
    except CheckFailure as problem:
        return f"{wrong}{problem}"
    return None


def call_learner(fn: Any, *args: Any, name: str | None = None, error_hint: str = "", **kwargs: Any) -> Any:
    """Call the learner's ``fn``; turn its exceptions into hints that name the call.

    ``error_hint`` is appended when the learner's code raises: a pointer to the usual cause.
    """
    label = name or getattr(fn, "__name__", "your function")
    if not callable(fn):
        raise CheckFailure(f"expected a function or module for `{label}`, got {type(fn).__name__}")
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise ExerciseNotDone(NOT_DONE_MESSAGE) from None
    except CheckFailure:
        raise
    except Exception as err:
        shapes = ", ".join(describe(a) for a in args)
        hint = f" ({error_hint})" if error_hint else ""
        raise CheckFailure(f"`{label}({shapes})` raised {type(err).__name__}: {err}{hint}") from None


@contextlib.contextmanager
def watch_calls(*targets: tuple[Any, str]) -> Iterator[list[str]]:
    """Record which of the functions ``(owner, attribute)`` are called while the block runs.

    Used to name a shortcut ("you called torch.softmax; build it from exp and sum").
    The originals are restored on exit, whatever happens inside.
    """
    called: list[str] = []
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr in targets]

    def recorder(label: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            called.append(label)
            return original(*args, **kwargs)

        return wrapped

    try:
        for owner, attr, original in originals:
            label = f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}"
            setattr(owner, attr, recorder(label, original))
        yield called
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)


def call_on_copies(fn: Any, args: dict[str, Any], *, name: str, mutated_hint: str, error_hint: str = "") -> Any:
    """``fn`` on copies of the tensors in ``args`` (a name ``"kw:eps"`` goes as the keyword ``eps=``).

    A tensor the learner changed in place fails with ``mutated_hint`` (formatted with its name).
    """
    copies = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in args.items()}
    positional = [value for key, value in copies.items() if not key.startswith("kw:")]
    keywords = {key[3:]: value for key, value in copies.items() if key.startswith("kw:")}
    result = call_learner(fn, *positional, name=name, error_hint=error_hint, **keywords)
    for key, value in args.items():
        if isinstance(value, torch.Tensor) and not torch.equal(copies[key].detach(), value.detach()):
            raise CheckFailure(mutated_hint.format(name=key.removeprefix("kw:")))
    return result


def name_mistake(got: torch.Tensor, expected: torch.Tensor, mistakes: Iterable[tuple[str, torch.Tensor]], *,
                  rtol: float = 1e-3, atol: float = 1e-2) -> None:
    """Name the first known mistake that ``got`` matches, by default loosely (``compare`` matches tightly).

    Some mistakes turn pairs by thousands of radians (frequencies that grow along the vector), where
    a float32 answer is off from the float64 mistake by more than the reference's tolerance.
    ``mistakes`` is a sequence of (hint, wrong output): one mistake may come in several forms.
    """
    for hint, wrong in mistakes:
        if wrong.shape == got.shape and is_close(got, wrong, rtol=rtol, atol=atol) and not is_close(
            wrong, expected, rtol=rtol, atol=atol
        ):
            raise CheckFailure(hint)


def global_names(fn: Any) -> set[str]:
    """The global names a function's code (and the functions and lambdas inside it) refers to."""
    names: set[str] = set()
    pending = [fn.__code__] if isinstance(getattr(fn, "__code__", None), types.CodeType) else []
    while pending:
        current = pending.pop()
        names.update(current.co_names)
        pending.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return names


def from_modules(value: Any, modules: Iterable[str]) -> bool:
    """True when ``value`` is one of the named modules, is defined in one, or is a functools.partial of such a thing.

    >>> import tfedu.softmax
    >>> from_modules(functools.partial(tfedu.softmax.softmax, dim=-1), ["tfedu.softmax"]), from_modules(len, ["tfedu.softmax"])
    (True, False)
    """
    while isinstance(value, functools.partial):
        value = value.func
    name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
    return name in tuple(modules)


def globals_from_modules(fn: Any, modules: Iterable[str]) -> list[str]:
    """The global names ``fn``'s code uses whose objects come from the named modules (found by object, whatever the
    name), sorted: how a checker sees an answer that calls the reference it is meant to rebuild."""
    scope = getattr(fn, "__globals__", {})
    return sorted(n for n in global_names(fn) if n in scope and from_modules(scope[n], modules))


def describe(value: Any) -> str:
    """A short description of a value for hints: tensors by shape and dtype."""
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, np.ndarray):
        return f"array{value.shape} {value.dtype}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def seeded_randn(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard-normal values from a private generator: the same inputs every call."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def is_close(a: torch.Tensor, b: torch.Tensor, *, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """True when two tensors have one shape and equal values within tolerance (NaNs never match)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return False
    return bool(torch.allclose(a.detach().double().cpu(), b.detach().double().cpu(), rtol=rtol, atol=atol))


def compare(
    actual: Any,
    expected: torch.Tensor,
    *,
    what: str,
    mistakes: Mapping[str, torch.Tensor] | None = None,
    nan_hint: str | None = None,
    check_dtype: bool = True,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> None:
    """Compare the learner's tensor with the reference, naming a known mistake when one matches.

    Order: type, shape, NaN/Inf, known mistakes, then values. ``mistakes`` maps a hint to
    the output that mistake would produce on the same inputs.
    """
    if isinstance(actual, np.ndarray):
        actual = torch.from_numpy(actual)
    if not isinstance(actual, torch.Tensor):
        raise CheckFailure(f"{what} should be a torch.Tensor, got {type(actual).__name__}")
    if type(actual) is not torch.Tensor:
        actual = actual.as_subclass(torch.Tensor)  # never trust a subclass's overridden comparisons
    if actual.shape != expected.shape:
        for hint, wrong in (mistakes or {}).items():
            if isinstance(wrong, torch.Tensor) and wrong.shape == actual.shape and is_close(actual, wrong, rtol=rtol, atol=atol):
                raise CheckFailure(hint)
        raise CheckFailure(f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if check_dtype and actual.dtype != expected.dtype:
        raise CheckFailure(f"{what} has dtype {actual.dtype}, expected {expected.dtype}")
    if actual.is_floating_point() and not torch.isfinite(actual).all() and torch.isfinite(expected).all():
        raise CheckFailure(nan_hint or f"{what} contains NaN or Inf where the reference is finite")
    for hint, wrong in (mistakes or {}).items():
        if is_close(actual, wrong, rtol=rtol, atol=atol) and not is_close(wrong, expected, rtol=rtol, atol=atol):
            raise CheckFailure(hint)
    if not is_close(actual, expected, rtol=rtol, atol=atol):
        diff = (actual.detach().double().cpu() - expected.detach().double().cpu()).abs()
        worst = int(diff.argmax())
        got, want = actual.flatten()[worst].item(), expected.flatten()[worst].item()
        if not diff.dim():  # one number: no index to name
            raise CheckFailure(f"{what} differs from the reference: got {got:.6g}, expected {want:.6g}")
        index = tuple(int(i) for i in np.unravel_index(worst, tuple(diff.shape)))
        raise CheckFailure(
            f"{what} differs from the reference: largest error {diff.max().item():.3g} at index {index}"
            f" (got {got:.6g}, expected {want:.6g})"
        )


def expect(condition: bool, hint: str) -> None:
    """Fail with ``hint`` unless ``condition`` holds."""
    if not condition:
        raise CheckFailure(hint)


@dataclass(frozen=True)
class Probe:
    """How the autograder tests one exercise with fresh inputs, outside the learner's interpreter.

    The grader draws ``make_inputs(rng)`` (plain data: NumPy arrays, ints, floats, strings,
    lists, dicts), runs the code ``run`` in the student's kernel with those bound to the name
    ``inputs`` (it must bind ``outputs`` to plain data computed with the learner's objects), and
    compares ``outputs`` with ``reference(inputs)`` in its own process.

    ``standins`` is Python source, written by us, defining the functions of *earlier* exercises
    that this exercise's answer may call, under the names the notebook uses (``attention`` for
    ``self_attention``). While this exercise's check cell and hidden test run, the grader binds
    those names in the notebook's globals to the stand-ins and puts the learner's own bindings
    back afterwards, so one wrong answer costs one exercise. See :func:`standin_objects`.
    """

    exercise: str  # grade_id of the solution cell this probe grades
    make_inputs: Callable[[np.random.Generator], dict[str, Any]]
    run: str  # code run in the kernel: reads `inputs`, binds `outputs`
    reference: Callable[[dict[str, Any]], dict[str, Any]]
    forbidden: tuple[str, ...] = ()  # tfedu modules or names the answer must not use
    # The library functions and classes the answer may use: the elementary operations unless the exercise
    # names more groups (tfedu.checks.building_blocks); None: any (an exercise about a library's own API).
    builds: frozenset[str] | None = ELEMENTARY
    rtol: float = 1e-4
    atol: float = 1e-5
    compare: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = None  # custom: returns a failure message
    extra: dict[str, Any] = field(default_factory=dict)
    standins: str = ""  # source defining earlier exercises' functions, bound in place of the learner's (see above)


# What the stand-in source finds when it runs: nothing else (no tfedu, whose tripwire would fire).
STANDIN_GLOBALS = {"torch": torch, "np": np, "math": math, "F": F}


def standin_objects(probe: Probe) -> dict[str, Any]:
    """The stand-ins of ``probe``: every public name its ``standins`` source binds, with its object.

    The source runs in a fresh namespace holding only ``torch``, ``np``, ``math`` and ``F``
    (``torch.nn.functional``); the names it binds that do not start with an underscore are the
    stand-ins (names with an underscore are private helpers of the stand-ins). The stand-ins keep
    that namespace as their globals, so they never see the learner's objects.

    >>> from tfedu.checks.nb04_attention import PROBES
    >>> sorted(standin_objects(PROBES["check_self_attention"]))
    ['attention']
    """
    if not probe.standins:
        return {}
    scope: dict[str, Any] = dict(STANDIN_GLOBALS)
    exec(compile(probe.standins, f"<stand-ins for {probe.exercise}>", "exec"), scope)
    return {name: value for name, value in scope.items()
            if not name.startswith("_") and (name not in STANDIN_GLOBALS or value is not STANDIN_GLOBALS[name])}


_ABSENT = object()


@contextlib.contextmanager
def names_bound(namespace: MutableMapping[str, Any], replacements: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Bind ``replacements`` in ``namespace`` (a notebook's globals) while the block runs.

    Afterwards every name is as it was: the learner's own object put back, or the name removed
    when the learner had not defined it. Yields the replacements.
    """
    saved = {name: namespace.get(name, _ABSENT) for name in replacements}
    namespace.update(replacements)
    try:
        yield replacements
    finally:
        for name, value in saved.items():
            if value is _ABSENT:
                namespace.pop(name, None)
            else:
                namespace[name] = value


@contextlib.contextmanager
def standins_bound(probe: Probe, namespace: MutableMapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Bind ``probe``'s stand-ins in ``namespace`` (the notebook's globals) while the block runs (``names_bound``)."""
    with names_bound(namespace, standin_objects(probe)) as replacements:
        yield dict(replacements)


PLAIN_TYPES = (np.ndarray, np.generic, bool, int, float, str, type(None))


def is_plain_data(value: Any) -> bool:
    """True for what a probe may pass between processes: arrays, numbers, strings, lists, dicts."""
    if isinstance(value, (list, tuple)):
        return all(is_plain_data(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain_data(v) for k, v in value.items())
    return isinstance(value, PLAIN_TYPES) and not (isinstance(value, np.ndarray) and value.dtype == object)


def run_probe(
    probe: Probe, namespace: MutableMapping[str, Any], seed: int, *, standins: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``probe`` in this process against the objects in ``namespace``: ``(outputs, expected)``.

    The grader does the same in the student's kernel; this is for testing probes and for
    instructors writing new ones. With ``standins=True`` the probe's stand-ins are bound in
    ``namespace`` itself while the probe runs, as the grader binds them in the notebook's
    globals (so functions whose globals are ``namespace`` see them), and unbound afterwards.

    >>> from tfedu.checks.nb00_start_here import PROBES
    >>> from tfedu.softmax import softmax
    >>> outputs, expected = run_probe(PROBES["check_softmax"], {"softmax": softmax}, seed=0)
    >>> PROBES["check_softmax"].compare(outputs, expected) is None
    True
    """
    inputs = probe.make_inputs(np.random.default_rng(seed))
    if not is_plain_data(inputs):
        raise TypeError(f"probe for {probe.exercise}: make_inputs must return plain data, got {describe(inputs)}")
    with standins_bound(probe, namespace) if standins else contextlib.nullcontext():
        scope = {**namespace, "inputs": inputs, "np": np, "torch": torch}
        exec(probe.run, scope)
    if "outputs" not in scope:
        raise KeyError(f"probe for {probe.exercise}: its run code did not bind `outputs`")
    return scope["outputs"], probe.reference(inputs)


def compare_plain(actual: Any, expected: Any, rtol: float, atol: float, where: str = "outputs") -> str | None:
    """None when ``actual`` (plain data from the kernel) matches ``expected``; else what differs."""
    if hasattr(expected, "detach") and hasattr(expected, "numpy"):
        expected = expected.detach().cpu().numpy()
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{where} should be a dict, got {type(actual).__name__}"
        for key in expected:
            if key not in actual:
                return f"{where} has no entry {key!r}"
            problem = compare_plain(actual[key], expected[key], rtol, atol, f"{where}[{key!r}]")
            if problem:
                return problem
        return None
    if isinstance(expected, str) or expected is None or isinstance(expected, bool):
        return None if type(actual) is type(expected) and actual == expected else f"{where} is {str(actual)[:60]!r}, expected {str(expected)[:60]!r}"
    if isinstance(expected, (list, tuple)) and not all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in expected):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return f"{where} should be a list of {len(expected)} items"
        for i, (a, e) in enumerate(zip(actual, expected)):
            problem = compare_plain(a, e, rtol, atol, f"{where}[{i}]")
            if problem:
                return problem
        return None
    e = np.asarray(expected)
    if not (isinstance(actual, (np.ndarray, list, int, float)) and not isinstance(actual, bool) or e.dtype.kind == "b"):
        return f"{where} should be numbers, got {type(actual).__name__}"
    try:
        a = np.asarray(actual)
    except (ValueError, TypeError):
        return f"{where} is not a rectangular array of numbers"
    if a.dtype.kind not in "biuf":
        return f"{where} should hold numbers, got dtype {a.dtype}"
    if a.shape != e.shape:
        return f"{where} has shape {a.shape}, expected {e.shape}"
    if e.dtype.kind == "f" or a.dtype.kind == "f":
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        if not np.isfinite(a64).all() and np.isfinite(e64).all():
            return f"{where} contains NaN or Inf where the reference is finite"
        if not np.allclose(a64, e64, rtol=rtol, atol=atol, equal_nan=False):
            diff = np.abs(a64 - e64)
            diff = np.where(np.isnan(diff), np.inf, diff)
            worst = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.ndim else ()
            return f"{where} differs from the reference: largest error {float(np.max(diff)):.3g} at index {tuple(int(i) for i in worst)}"
        return None
    return None if np.array_equal(a, e) else f"{where} differs from the reference"
