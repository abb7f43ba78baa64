"""Switch cells: run an experiment with the learner's function only when it passes its check.

A notebook's switch cell (``USE_MY_SGNS_LOSS = True``) asks an experiment to run the learner's
function. If that function is wrong, the experiment would fail far from the cause, with a bare
assert. :func:`pick` runs the exercise's checker first; when it fails, it prints why and hands back
the reference, so the rest of the notebook still runs.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

from tfedu.checks.core import TICK

WARNING = "\N{WARNING SIGN}"


def pick(switch: str, on: bool, mine: Any, reference: Any, check: Callable[..., None], *check_args: Any,
         exercise: str, name: str | None = None, reference_is: str | None = None) -> Any:
    """``mine`` when the switch is on and ``check(mine, *check_args)`` passes; otherwise ``reference``.

    The messages call the reference "tfedu's reference <name>" unless ``reference_is`` says what it is
    ("PyTorch's fused F.layer_norm").

    Used by every switch cell (notebooks 01 to 05), so a wrong answer never breaks the experiment after it.

    >>> from tfedu.checks.nb00_start_here import check_softmax
    >>> from tfedu.softmax import softmax
    >>> pick("USE_MY_SOFTMAX", False, None, softmax, check_softmax, exercise="0.1") is softmax
    USE_MY_SOFTMAX = False: running tfedu's reference softmax (set it to True once exercise 0.1 passes)
    True
    >>> pick("USE_MY_SOFTMAX", False, None, softmax, check_softmax, exercise="0.1", reference_is="torch.softmax") is softmax
    USE_MY_SOFTMAX = False: running torch.softmax (set it to True once exercise 0.1 passes)
    True
    >>> wrong = lambda x: x
    >>> pick("USE_MY_SOFTMAX", True, wrong, softmax, check_softmax, exercise="0.1") is softmax  # doctest: +ELLIPSIS
    ⚠ USE_MY_SOFTMAX = True, but your softmax does not pass exercise 0.1's check: ...
    True
    """
    label = name or getattr(reference, "__name__", "function")
    runs = reference_is or f"tfedu's reference {label}"
    several = " and " in exercise  # "9.3 and 9.4": one switch over two exercises
    if not on:
        once = f"exercises {exercise} pass" if several else f"exercise {exercise} passes"
        print(f"{switch} = False: running {runs} (set it to True once {once})")
        return reference
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            check(mine, *check_args)
    except AssertionError as failure:  # CheckFailure and ExerciseNotDone are AssertionErrors
        print(f"{WARNING} {switch} = True, but your {label} does not pass exercise{'s' if several else ''} "
              f"{exercise}'s check{'s' if several else ''}: {failure}\n"
              f"  From here on {runs} runs instead, so the rest of the notebook still runs; "
              f"fix exercise{'s' if several else ''} {exercise}, or set {switch} = False.")
        return reference
    print(f"{TICK} {switch} = True: running your {label} (it passes exercise{'s' if several else ''} {exercise}'s "
          f"check{'s' if several else ''})")
    return mine
