"""The tamper suite: real submissions built from the released notebook 00, each trying one trick.

Every `tests/tamper/zero_*.py` is an answer cell for exercise `ex_softmax` that tries to get
marks it has not earned; every `tests/tamper/full_*.py` is a correct answer written in some
awkward way. The cases in STRUCTURE change the notebook around the answer (check cells edited,
deleted, duplicated, points changed, ...) and MALFORMED are files that are not notebooks.

Everything is graded in ONE `grade` call with a few jobs at once and short limits, so one
submission crashing, looping or flooding the output must not touch the others.
"""

import copy
import json
import time
from pathlib import Path

import nbformat
import pytest

from tfedu.course import nbtools
from tfedu.course.grading.grade import Limits, grade
from tfedu.course.grading.release import student_version
from tfedu.checks.scan import MAX_ANSWER_CHARS, SCAN_SECONDS

from grading_limits import calibrated as calibrated_limits
from optional_parts import sandbox_or_skip

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "notebooks" / "00_start_here.ipynb"
TAMPER = Path(__file__).resolve().parent / "tamper"
# The limits on an idle machine; `calibrated` scales them to what the correct answer costs here and now.
IDLE_LIMITS = Limits(cell_timeout=8.0, timeout=40.0, memory_gib=2.0)
NEAR_LIMIT = 5 / 8  # the near-limit answer sleeps this fraction of the per-cell limit
CHECK, ANSWER = "check_softmax", "ex_softmax"
CORRECT = (TAMPER / "full_correct.py").read_text().split("\n", 1)[1]
STUB = (TAMPER / "zero_stub.py").read_text().split("\n", 1)[1]
# The stub with a line of the learner's: no longer the release's stub, so it runs (and its check cell raises
# ExerciseNotDone) instead of being decided before the run. The structural tricks below go with it, so that
# the grader's run, not the static phase, is what they meet.
RUNNING_STUB = STUB.replace("    # YOUR CODE HERE\n", "    # YOUR CODE HERE\n    # (later)\n")
assert RUNNING_STUB != STUB


def released():
    return student_version(nbtools.read(SOURCE), SOURCE.name)


def cell_index(nb, grade_id):
    return next(i for i, c in enumerate(nb.cells) if (nbtools.nbgrader_meta(c) or {}).get("grade_id") == grade_id)


def with_answer(source, nb=None):
    nb = nb or released()
    nb.cells[cell_index(nb, ANSWER)].source = source
    return nb


def edited_check_cell():
    nb = with_answer(RUNNING_STUB)
    nb.cells[cell_index(nb, CHECK)].source = 'print("\N{CHECK MARK} stable softmax: all checks passed")'
    return nb


def deleted_check_cell():
    nb = with_answer(RUNNING_STUB)
    del nb.cells[cell_index(nb, CHECK)]
    return nb


def duplicated_check_cells():
    nb = with_answer(RUNNING_STUB)
    i = cell_index(nb, CHECK)
    fake = copy.deepcopy(nb.cells[i])
    fake.source = "softmax = lambda x: x  # replaced before the check runs"
    nb.cells[i:i] = [fake, copy.deepcopy(fake)]
    return nb


def points_changed():
    nb = with_answer(RUNNING_STUB)
    nb.cells[cell_index(nb, CHECK)].metadata["nbgrader"]["points"] = 100
    return nb


def answer_metadata_removed():
    nb = with_answer(CORRECT)
    del nb.cells[cell_index(nb, ANSWER)].metadata["nbgrader"]
    return nb


def answer_moved_to_a_markdown_cell():
    nb = with_answer(CORRECT)
    cell = nb.cells[cell_index(nb, ANSWER)]
    nb.cells[cell_index(nb, ANSWER)] = nbformat.v4.new_markdown_cell(cell.source, metadata=cell.metadata)
    return nb


def student_cell_defines_the_answer():
    nb = with_answer(RUNNING_STUB)
    nb.cells.insert(cell_index(nb, ANSWER), nbformat.v4.new_code_cell("from tfedu.softmax import softmax as _s\nsoftmax = _s"))
    nb.cells.insert(cell_index(nb, CHECK), nbformat.v4.new_code_cell("softmax = _s"))
    return nb


def duplicated_answer_cells_first_is_stub():
    nb = with_answer(RUNNING_STUB)
    i = cell_index(nb, ANSWER)
    second = copy.deepcopy(nb.cells[i])
    second.source = "from tfedu.softmax import softmax"
    nb.cells.insert(i + 1, second)
    return nb


def kernelspec_and_language_changed():
    nb = with_answer(RUNNING_STUB)
    nb.metadata["kernelspec"] = {"name": "bash", "display_name": "Bash", "language": "bash"}
    nb.metadata["nbgrader"] = {"graded": True, "total": 2}
    return nb


def answer_cell_marked_as_check_with_points():
    nb = with_answer(RUNNING_STUB)
    meta = nb.cells[cell_index(nb, ANSWER)].metadata["nbgrader"]
    meta.update(grade=True, points=50)
    return nb


def correct_with_noisy_student_tests():
    """Correct answer; the student's own test cells warn to stderr, fail and print fake results."""
    nb = with_answer(CORRECT)
    i = cell_index(nb, CHECK)
    nb.cells.insert(i + 1, nbformat.v4.new_code_cell(
        "import warnings, sys\nwarnings.warn('my own test warns')\nprint('debug', file=sys.stderr)\nassert softmax(torch.zeros(3)).sum() == 1"))
    nb.cells.insert(i + 2, nbformat.v4.new_code_cell("raise ValueError('my scratch cell is broken')"))
    return nb


def correct_with_check_cell_deleted():
    nb = with_answer(CORRECT)
    del nb.cells[cell_index(nb, CHECK)]
    return nb


def correct_with_kernelspec_changed():
    nb = with_answer(CORRECT)
    nb.metadata["kernelspec"] = {"name": "ir", "display_name": "R", "language": "R"}
    return nb


def scan_bomb_of_escape_lines():
    """Hundreds of `!` and `%` lines: IPython's transformer re-tokenises the whole cell for each one."""
    return with_answer(STUB + "".join(f"\n!echo {i}\n%env X{i}=1" for i in range(400)))


def deep_attribute_chain():
    """Chains hundreds of links deep: checked at every link, the scan was quadratic in their depth."""
    return with_answer(STUB + "".join(f"\nvalue_{i} = torch._hidden" + ".link" * 450 for i in range(4)))


def oversized_answer_cell():
    """A correct answer padded past the size limit: the size alone scores zero, nothing runs."""
    return with_answer(CORRECT + "\n# padding" * (MAX_ANSWER_CHARS // 10 + 1))


STRUCTURE = {  # name -> (builder, expected points on check_softmax)
    "zero_edited_check_cell": (edited_check_cell, 0),
    "zero_deleted_check_cell": (deleted_check_cell, 0),
    "zero_duplicated_check_cells": (duplicated_check_cells, 0),
    "zero_points_changed": (points_changed, 0),
    "zero_answer_metadata_removed": (answer_metadata_removed, 0),
    "zero_answer_in_markdown_cell": (answer_moved_to_a_markdown_cell, 0),
    "zero_student_cell_defines_answer": (student_cell_defines_the_answer, 0),
    "zero_duplicated_answer_cells": (duplicated_answer_cells_first_is_stub, 0),
    "zero_kernelspec_changed": (kernelspec_and_language_changed, 0),
    "zero_answer_cell_marked_as_check": (answer_cell_marked_as_check_with_points, 0),
    "full_noisy_student_tests": (correct_with_noisy_student_tests, 2),
    "full_check_cell_deleted": (correct_with_check_cell_deleted, 2),
    "full_kernelspec_changed": (correct_with_kernelspec_changed, 2),
    "zero_scan_bomb_escape_lines": (scan_bomb_of_escape_lines, 0),
    "zero_scan_bomb_deep_chain": (deep_attribute_chain, 0),
    "zero_oversized_answer_cell": (oversized_answer_cell, 0),
}

MALFORMED = {  # name -> file content (bytes)
    "malformed_invalid_json": b'{"cells": [ {"cell_type": "code", ',
    "malformed_zero_cells": json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": []}).encode(),
    "malformed_nbformat_3": json.dumps({"nbformat": 3, "nbformat_minor": 0, "metadata": {},
                                        "worksheets": [{"cells": [{"cell_type": "code", "input": CORRECT, "metadata": {
                                            "nbgrader": {"grade_id": ANSWER, "solution": True}}}]}]}).encode(),
    "malformed_python_file": (TAMPER / "full_correct.py").read_bytes(),
    "malformed_empty_file": b"",
    "malformed_json_list": b"[1, 2, 3]",
    "malformed_binary": bytes(range(256)) * 4,
    "malformed_cell_types": json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        "not a cell", {"cell_type": "code", "source": 42, "metadata": {"nbgrader": {"grade_id": ANSWER}}},
        {"cell_type": "code", "source": [1, 2], "metadata": {"nbgrader": "ex_softmax"}}]}).encode(),
}

ANSWER_FILES = sorted(TAMPER.glob("*_*.py"))
CASES = [p.stem for p in ANSWER_FILES if p.stem.startswith(("zero_", "full_"))] + list(STRUCTURE) + list(MALFORMED)


def expected_points(name):
    if name in STRUCTURE:
        return STRUCTURE[name][1]
    return 2 if name.startswith("full_") else 0


def calibrated(folder):
    """IDLE_LIMITS scaled to this machine as loaded now (tests/grading_limits.py), from the correct answer."""
    path = folder / "calibration" / SOURCE.name
    path.parent.mkdir()
    path.write_text(nbformat.writes(with_answer(CORRECT)))
    return calibrated_limits(IDLE_LIMITS, path, SOURCE)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    sandbox_or_skip()
    folder = tmp_path_factory.mktemp("submissions")
    limits, correct_seconds = calibrated(folder)
    paths = {}
    for path in ANSWER_FILES:
        if not path.stem.startswith(("zero_", "full_")):
            continue
        answer = path.read_text().replace("NEAR_LIMIT_SLEEP", repr(NEAR_LIMIT * limits.cell_timeout))
        paths[path.stem] = folder / f"{path.stem}.ipynb"
        paths[path.stem].write_text(nbformat.writes(with_answer(answer)))
    for name, (build, _) in STRUCTURE.items():
        nb = build()
        for cell in nb.cells:  # copied cells share ids; give each its own, as Jupyter would
            cell.id = nbformat.v4.new_code_cell().id
        paths[name] = folder / f"{name}.ipynb"
        paths[name].write_text(nbformat.writes(nb))
    for name, content in MALFORMED.items():
        paths[name] = folder / f"{name}.ipynb"
        paths[name].write_bytes(content)
    start = time.monotonic()
    results = grade(list(paths.values()), out=folder / "results.json", source=SOURCE, limits=limits, jobs=4)
    elapsed = time.monotonic() - start
    by_file = {Path(e["file"]).stem: e for e in results["submissions"]}
    print(f"limits {limits} from a correct run of {correct_seconds:.1f} s")
    return {"entries": by_file, "elapsed": elapsed, "folder": folder, "count": len(paths), "limits": limits}


@pytest.mark.parametrize("name", CASES)
def test_each_trick_scores_zero_and_each_correct_answer_full_marks(graded, name):
    entry = graded["entries"][name]
    exercise = entry["exercises"][CHECK]
    assert entry["max"] == 2 and exercise["max"] == 2
    assert exercise["points"] == expected_points(name), exercise["feedback"]
    assert entry["total"] == exercise["points"]
    assert exercise["feedback"]


FEEDBACK = {  # the message says why
    "zero_stub": "not done yet",
    "zero_naive_overflows": "NaN or Inf",
    "zero_wrong_dim": "dim 0",
    "zero_import_reference": "reference",
    "zero_reference_module_alias": "tfedu.softmax",
    "zero_dunder_import": "__import__",
    "zero_importlib": "importlib",
    "zero_sys_modules": "sys.modules",
    "zero_exec_string": "exec",
    "zero_reference_via_check_module": "called the reference",
    "zero_monkeypatch_allclose": "monkeypatching",
    "zero_patch_checks": "tfedu.checks",
    "zero_patch_grader": "tfedu.course.grading",
    "zero_set_custom_exc": "get_ipython",
    "zero_sys_excepthook": "sys.excepthook",
    "zero_memorised_check_inputs": "fresh random inputs",
    "zero_reference_through_another_module": "which is `torch.nn.functional.softmax`",
    "zero_os_through_another_module": "`os.system` (found `torch.serialization.os.system`, which is `os.system`)",
    "zero_unbound_method_self": "take a method from its class (`_Settings.set`)",
    "zero_segfault": "`numpy.lib.stride_tricks.as_strided` (found `np.lib.stride_tricks.as_strided`) is not one of them",
    "zero_infinite_loop_top_level": "time limit",
    "zero_infinite_loop_in_function": "time limit",
    "zero_huge_sleep": "time limit",
    "zero_input": "input",
    "zero_shell_bang": "get_ipython",
    "zero_subprocess_reference": "subprocess",
    "zero_always_equal": "check cell failed",
    "zero_syntax_error": "not valid Python",
    "zero_answer_metadata_removed": "no answer cell",
    "malformed_invalid_json": "not valid JSON",
    "malformed_nbformat_3": "nbformat 3",
    "malformed_zero_cells": "no cells",
    "malformed_python_file": "not a Jupyter notebook",
    "malformed_binary": "not a Jupyter notebook",
    "zero_write_module_and_import": "write",
    "zero_private_torch": "private",
    "zero_pickle_payload": "pickle",
    "full_correct": "passed",
    "zero_attrgetter_private_softmax": "operator",
    "zero_module_patch_through_plain_name": "may only set attributes of `self`",
    "zero_log_softmax_exp": "torch.log_softmax",
    "zero_special_log_softmax": "torch.special.log_softmax",
    "zero_getattr_passed_around": "may only call `getattr` directly",
    "zero_setsid_daemon_via_collect_env": "torch.utils.collect_env",
    "zero_fileio_write": "write",
    "zero_scan_bomb_escape_lines": "static scan of the answer cell ran past its limit",
    "zero_scan_bomb_deep_chain": "private internals",
    "zero_oversized_answer_cell": f"over the limit of {MAX_ANSWER_CHARS:,}; nothing was run",
    "zero_ansi_forged_report": "ValueError",
    "zero_inplace_softmax": "changed its input in place",
}


def test_nothing_the_tricks_tried_to_leave_behind_survives(graded):
    import subprocess

    assert not Path("/tmp/tfedu_tamper_fileio.txt").exists() and not Path("/tmp/tfedu_tamper_dir").exists()
    leftover = subprocess.run(["pgrep", "-f", "sleep 4711"], capture_output=True, text=True).stdout
    assert not leftover.strip(), f"a process started by a submission outlived grading: {leftover}"


@pytest.mark.parametrize("name", FEEDBACK)
def test_feedback_names_the_reason(graded, name):
    assert FEEDBACK[name] in graded["entries"][name]["exercises"][CHECK]["feedback"]


def test_results_json_and_csv_have_one_row_per_submission(graded):
    folder = graded["folder"]
    data = json.loads((folder / "results.json").read_text())
    assert len(data["submissions"]) == graded["count"]
    for entry in data["submissions"]:
        assert set(entry) >= {"file", "total", "max", "exercises"}
        assert set(entry["exercises"][CHECK]) == {"points", "max", "feedback"}
    rows = (folder / "results.csv").read_text().strip().splitlines()
    assert rows[0] == "file,total,max,check_softmax"
    assert len(rows) == graded["count"] + 1


def test_the_whole_suite_is_graded_in_bounded_time(graded):
    # Every looping case costs at most one cell limit plus a kernel restart; the rest run in parallel.
    print(f"graded {graded['count']} submissions in {graded['elapsed']:.1f} s")
    assert graded["elapsed"] < 240 * graded["limits"].cell_timeout / IDLE_LIMITS.cell_timeout


@pytest.mark.parametrize("name", ["zero_scan_bomb_escape_lines", "zero_scan_bomb_deep_chain", "zero_oversized_answer_cell"])
def test_a_scan_bomb_is_stopped_by_the_scan_limits(graded, name):
    entry = graded["entries"][name]
    assert entry["total"] == 0
    # the scan stops at SCAN_SECONDS; the rest is one kernel running the notebook with the stub
    assert entry["seconds"] < SCAN_SECONDS + graded["limits"].timeout / 2, entry["seconds"]
    assert len(entry["exercises"][CHECK]["feedback"]) < 2000


def control_characters(text):
    return [c for c in text if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) < 0xA0 or c in "\u202e\u2066\u2067\u2068\u2069"]


def test_an_error_message_cannot_forge_the_report(graded, capsys, monkeypatch):
    import argparse
    import importlib

    from tfedu.course.grading import cli

    grade_module = importlib.import_module("tfedu.course.grading.grade")  # the package re-exports `grade`, the function

    folder = graded["folder"]
    entry = graded["entries"]["zero_ansi_forged_report"]
    feedback = entry["exercises"][CHECK]["feedback"]
    assert entry["total"] == 0 and "ValueError" in feedback
    assert not control_characters(feedback), feedback
    written = json.loads((folder / "results.json").read_text())
    for e in written["submissions"]:
        for text in [e["file"], *e["notes"], *(x["feedback"] for x in e["exercises"].values())]:
            assert not control_characters(text), text
    assert not control_characters((folder / "results.csv").read_text().replace("\r\n", "\n"))
    # the console report: one line per exercise, nothing that moves the cursor or erases a line
    monkeypatch.setattr(grade_module, "grade", lambda *a, **k: {"submissions": [entry]})
    args = argparse.Namespace(submissions=[], out=str(folder / "x.json"), source=None, notebooks_dir=None, checks=None,
                              jobs=1, timeout=1.0, cell_timeout=1.0, memory_gib=1.0)
    cli._grade(args)
    printed = capsys.readouterr().out
    assert not control_characters(printed), printed
    assert [line for line in printed.splitlines() if CHECK in line] == [
        line for line in printed.splitlines() if line.startswith(f"  {CHECK}: 0 / 2")]
