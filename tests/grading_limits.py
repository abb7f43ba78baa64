"""Grading limits for tests that time submissions, scaled to the machine as loaded now.

A test that grades with short limits (the tamper suite, the sandbox attacks) must not fail a correct
answer because the machine is busy: under the suite's own load on 2 cores a kernel's start (importing
torch) took over 10 s, and the correct answers were stopped at limits chosen on an idle machine.
"""

import dataclasses
from pathlib import Path

from tfedu.course.grading.grade import Limits, grade


def calibrated(idle: Limits, correct: Path, source: Path) -> tuple[Limits, float]:
    """``idle`` scaled to this machine as loaded now, and the seconds the calibration run took.

    ``correct`` (a submission that scores full marks) is first graded alone with generous limits; no
    cell may then be stopped before twice that whole run (kernel start and every cell) has passed, and
    the total and start-up limits grow by the same factor. On a quiet machine ``idle`` stands."""
    [entry] = grade([correct], source=source, limits=Limits(cell_timeout=300, timeout=600), jobs=1)["submissions"]
    assert entry["total"] == entry["max"] > 0, entry["exercises"]
    cell = max(idle.cell_timeout, 2 * entry["seconds"])
    scale = cell / idle.cell_timeout
    return dataclasses.replace(idle, cell_timeout=cell, timeout=idle.timeout * scale,
                               startup_timeout=idle.startup_timeout * scale), entry["seconds"]
