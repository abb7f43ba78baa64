"""Hints in steps and, once tried, the reference solution: ``tfedu.hint("5.2")`` and ``tfedu.solution("5.2")``.

Every exercise has three hints (:class:`tfedu.checks.core.Hints`, kept beside its checker): the idea, then
the approach and the shapes, then a skeleton with blanks. ``hint("5.2")`` shows the next one each time it is
called (``hint("5.2", 3)`` a given one), in JupyterLab, Colab or a plain Python prompt alike: it displays
markdown where IPython can, and prints otherwise.

``solution("5.2")`` shows the solution from the course's source notebook, but only after the learner has
tried: after the exercise's checker has run in this interpreter (its check cell, pass or fail). A graded
course's release switches it off (``tfedu release --no-solutions`` adds :func:`solutions_off` to every
notebook's set-up cell). That is a course rule made convenient, not a lock: the source notebooks are public,
and the grade comes from the grader's own inputs.

The solutions travel inside the package (``solutions.json``, written by ``tfedu clean`` from the source
notebooks; tests/test_hints.py fails when it drifts), so a pip-installed tfedu on Colab has them too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tfedu.checks import carry, core
from tfedu.checks.carry import Exercise, exercises  # every exercise with hints, by number

SOLUTIONS = Path(__file__).with_name("solutions.json")
LEVELS = ("the idea", "the approach and the shapes", "a skeleton with blanks")
_shown: dict[str, int] = {}  # exercise number -> the last hint level shown in this interpreter
_off: list[str] = []  # why solution() is switched off, when it is


class UnknownExercise(KeyError):
    """No exercise has that number."""

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return str(self.args[0])


def _exercise(number: Any) -> Exercise:
    known = exercises()
    key = str(number).strip()
    if key not in known:
        numbers = ", ".join(sorted(known, key=carry.number_order))
        raise UnknownExercise(f"there is no exercise {key!r}: give its number as a string, as its header does, "
                              f"e.g. tfedu.hint(\"5.2\"). Exercises with hints: {numbers}")
    return known[key]


def _show(text: str) -> None:
    """Markdown where IPython displays (JupyterLab, Colab), plain text anywhere else."""
    try:
        from IPython import get_ipython

        if get_ipython() is not None:
            from IPython.display import Markdown, display

            display(Markdown(text))
            return
    except ImportError:
        pass
    print(text)


def hint_text(number: Any, level: int | None = None) -> str:
    """The text ``hint`` shows; advances the exercise's level when ``level`` is None."""
    exercise = _exercise(number)
    if level is None:
        level = min(_shown.get(exercise.number, 0) + 1, len(LEVELS) + 1)
    if not isinstance(level, int) or not 1 <= level <= len(LEVELS) + 1:
        raise ValueError(f"level must be 1, 2 or 3 (or None for the next hint), got {level!r}")
    _shown[exercise.number] = max(_shown.get(exercise.number, 0), min(level, len(LEVELS)))
    if level > len(LEVELS):
        then = (f"solutions are switched off in this course ({_off[-1]})" if _off else
                f"once you have run the check cell, `tfedu.solution(\"{exercise.number}\")` shows the reference solution")
        return (f"**Exercise {exercise.number}**: that was the last hint. Go back to them with "
                f"`tfedu.hint(\"{exercise.number}\", 1)` (or 2, 3); {then}.")
    hints = exercise.hints
    body = (hints.idea, hints.approach, f"Fill each `{core.BLANK}`:\n\n```python\n{hints.skeleton.strip()}\n```")[level - 1]
    after = ("ask again for the next" if level < len(LEVELS) else "the last hint; solutions are switched off here"
             if _off else f"after this, `tfedu.solution(\"{exercise.number}\")` once you have run its check")
    return f"**Exercise {exercise.number}, hint {level} of {len(LEVELS)}** ({LEVELS[level - 1]}; {after}):\n\n{body}"


def hint(number: Any, level: int | None = None) -> None:
    """Show the next hint for exercise ``number`` ("5.2"), or hint ``level`` (1, 2 or 3)."""
    return _show(hint_text(number, level))


def solutions() -> dict[str, dict[str, str]]:
    """The reference solutions, by exercise number: {"notebook", "grade_id", "code"}."""
    try:
        return json.loads(SOLUTIONS.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{SOLUTIONS} is missing: this tfedu was installed without its solutions; "
                                "reinstall it, or in a checkout run `tfedu clean`") from None


def solution_text(number: Any) -> str:
    """The text ``solution`` shows, or the reason it will not (yet)."""
    exercise = _exercise(number)
    if _off:
        return f"**Exercise {exercise.number}**: solutions are switched off in this course ({_off[-1]})."
    if f"{exercise.module}:{exercise.hints.check}" not in core.ATTEMPTED:
        return (f"**Exercise {exercise.number}**: try it first. Run its check cell (the one that calls "
                f"`{exercise.hints.check}`) at least once in this session, pass or fail; then ask again. Until "
                f"then, `tfedu.hint(\"{exercise.number}\")` gives hints in steps.")
    entry = solutions().get(exercise.number)
    if entry is None:
        return f"**Exercise {exercise.number}**: its solution is not in {SOLUTIONS.name}; run `tfedu clean` in a checkout."
    return (f"**Exercise {exercise.number}, the reference solution** (from `{entry['notebook']}`; yours may differ "
            f"and still be right):\n\n```python\n{entry['code'].strip()}\n```")


def solution(number: Any) -> None:
    """Show exercise ``number``'s reference solution, once its check has run in this session."""
    return _show(solution_text(number))


def solutions_off(reason: str = "a graded course: ask your instructor") -> None:
    """Switch ``solution`` off in this interpreter (a graded release's set-up cell calls it)."""
    _off.append(reason)


def collect_solutions(notebooks: list[Path]) -> dict[str, dict[str, str]]:
    """Each exercise's solution cell, markers removed, by exercise number, from the source notebooks."""
    from tfedu.course import nbtools

    found: dict[str, dict[str, str]] = {}
    for path in notebooks:
        for number, cell, _ in nbtools.exercise_cells(nbtools.read(path)):
            if cell.cell_type == "code":
                lines = [line for line in cell.source.split("\n")
                         if nbtools.BEGIN_SOLUTION not in line and nbtools.END_SOLUTION not in line]
                grade_id = nbtools.nbgrader_meta(cell)["grade_id"]
                found[number] = {"notebook": path.name, "grade_id": grade_id, "code": "\n".join(lines)}
    return found


def solutions_json(notebooks: list[Path]) -> str:
    return json.dumps(collect_solutions(notebooks), indent=1, ensure_ascii=False, sort_keys=True) + "\n"
