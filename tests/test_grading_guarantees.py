"""What `tfedu grade` promises, stated once and held: the README and `--help` say the same thing,
grading refuses without a sandbox unless told, and one mistake costs one exercise (reference
stand-ins for earlier exercises while a later one is graded)."""

import re
from pathlib import Path

import nbformat
import pytest

from tfedu.course import cli, nbtools
from tfedu.course.grading import harness, sandbox
from tfedu.course.grading.grade import Limits, grade
from tfedu.course.grading.release import student_version

from optional_parts import needs_sandbox

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_and_the_help_make_the_same_five_promises(capsys):
    readme = (ROOT / "README.md").read_text()
    promises = re.findall(r"^  (\d)\. (.+)$", readme[readme.index("What the grader promises"):], flags=re.M)[:5]
    assert [n for n, _ in promises] == ["1", "2", "3", "4", "5"]
    flat = " ".join(sandbox.GUARANTEES.split())
    for _, promise in promises:
        assert promise.rstrip(".") in flat, promise
    with pytest.raises(SystemExit):
        cli.main(["grade", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert all(promise.rstrip(".") in shown for _, promise in promises)
    assert "--no-sandbox" in shown and "does not promise" in shown


def test_grading_refuses_without_a_sandbox_unless_told(tmp_path, monkeypatch, capsys):
    source = ROOT / "notebooks" / "00_start_here.ipynb"
    submission = tmp_path / "00_start_here.ipynb"
    submission.write_text(nbformat.writes(student_version(nbtools.read(source))))
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.find.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxUnavailable, match="bubblewrap.*--no-sandbox"):
            grade([submission], source=source)
        out = tmp_path / "results.json"
        assert cli.main(["grade", str(submission), "--source", str(source), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "apt-get install bubblewrap" in err and "--no-sandbox" in err and not out.exists()
        assert cli.main(["grade", str(submission), "--source", str(source), "--out", str(out), "--no-sandbox",
                         "--timeout", "120"]) == 0
        assert "WITHOUT a sandbox" in capsys.readouterr().err and out.is_file()
    finally:
        sandbox.find.cache_clear()


def test_stand_in_cells_swap_the_learner_objects_and_put_them_back():
    learner_double = lambda x: 3 * x  # noqa: E731
    namespace = {"__builtins__": __builtins__, "double": learner_double}
    source = "def _two():\n    return 2\n\ndef double(x):\n    return _two() * x\n\ndef helper():\n    return torch.ones(1)\n"
    swap_in, swap_out = harness.standin_sources(source)
    exec(swap_in, namespace)
    assert namespace["double"](2) == 4 and namespace["helper"]().item() == 1.0
    assert "_two" not in namespace and "torch" not in namespace  # private helpers and the given modules stay inside
    # the kernel-side swap binds exactly what tfedu.checks.core.standin_objects calls the stand-ins
    from dataclasses import replace

    from tfedu.checks.core import standin_objects
    from tfedu.checks.nb00_start_here import PROBES

    assert set(standin_objects(replace(PROBES["check_softmax"], standins=source))) == {"double", "helper"}
    exec(swap_out, namespace)
    assert namespace["double"] is learner_double and "helper" not in namespace
    assert harness.STANDIN_STASH not in namespace


CHECKS_MODULE = '''
import numpy as np
from tfedu.checks.core import Probe, checker, expect

@checker("double")
def check_double(double):
    expect(double(3) == 6, "double(3) should be 6")

@checker("quadruple")
def check_quadruple(quadruple):
    expect(quadruple(3) == 12, "quadruple(3) should be 12")

def _inputs(rng):
    return {"x": int(rng.integers(-1000, 1000))}

PROBES = {
    "check_double": Probe(exercise="ex_double", make_inputs=_inputs, run="outputs = {'y': double(inputs['x'])}",
                          reference=lambda inputs: {"y": 2 * inputs["x"]}),
    "check_quadruple": Probe(exercise="ex_quadruple", make_inputs=_inputs, run="outputs = {'y': quadruple(inputs['x'])}",
                             reference=lambda inputs: {"y": 4 * inputs["x"]}, STANDINS),
}
'''


@needs_sandbox
@pytest.mark.parametrize("with_standins", [True, False], ids=["stand-ins", "control"])
def test_a_wrong_earlier_exercise_costs_only_itself(tmp_path, monkeypatch, with_standins):
    """Exercise B calls exercise A's function. With stand-ins a wrong A costs A alone; without
    them (the control) the same submission also loses B, which was right."""
    import sys

    name = f"cascade_checks_{with_standins}"
    standins = 'standins="def double(x):\\n    return 2 * x\\n"' if with_standins else 'standins=""'
    (tmp_path / f"{name}.py").write_text(CHECKS_MODULE.replace("STANDINS", standins))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    sys.modules.pop(name, None)
    source = tmp_path / "92_cascade.ipynb"
    nbtools.write(nbtools.new_notebook([
        nbtools.exercise("ex_double", "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION"),
        nbtools.check("check_double", f"from {name} import check_double\n\ncheck_double(double)", points=1),
        nbtools.exercise("ex_quadruple", "def quadruple(x):\n    ### BEGIN SOLUTION\n    return double(double(x))\n    ### END SOLUTION"),
        nbtools.check("check_quadruple", f"from {name} import check_quadruple\n\ncheck_quadruple(quadruple)", points=2),
    ]), source)
    nb = student_version(nbtools.read(source))
    answers = {"ex_double": "def double(x):\n    return 3 * x", "ex_quadruple": "def quadruple(x):\n    return double(double(x))"}
    for cell in nb.cells:
        grade_id = (nbtools.nbgrader_meta(cell) or {}).get("grade_id")
        if grade_id in answers:
            cell.source = answers[grade_id]
    submission = tmp_path / "submitted" / "92_cascade.ipynb"
    submission.parent.mkdir()
    submission.write_text(nbformat.writes(nb))
    [entry] = grade([submission], source=source, checks=name, limits=Limits(cell_timeout=30, timeout=120))["submissions"]
    points = {k: v["points"] for k, v in entry["exercises"].items()}
    assert points["check_double"] == 0
    assert points["check_quadruple"] == (2 if with_standins else 0), entry["exercises"]["check_quadruple"]["feedback"]


def test_the_scans_of_one_submission_share_one_time_budget(monkeypatch):
    """Each answer's scan stops at SCAN_SECONDS; all of a submission's scans together at
    SUBMISSION_SCAN_SECONDS, so many slow answers cannot add up to a stalled grader."""
    from tfedu.course.grading import grade as grade_module

    assignment = grade_module.load_assignment(ROOT / "notebooks" / "05_masks_and_heads.ipynb")
    answers = dict.fromkeys(assignment.answers, "x = 1")
    run = grade_module.Run(assignment, answers, Limits())
    grade_module.static_phase(run)
    assert not run.stubbed  # a plain answer passes
    monkeypatch.setattr(grade_module, "SUBMISSION_SCAN_SECONDS", 0.0)
    run = grade_module.Run(assignment, answers, Limits())
    grade_module.static_phase(run)
    assert set(run.stubbed) == set(assignment.answers)
    assert all("ran past its total limit" in why for why in run.stubbed.values())
    assert all(points == 0 for points, _ in run.outcome.values()) and set(run.outcome) == set(assignment.probes)


def test_the_tripwire_sees_fused_kernels_called_as_torch_ops():
    """`torch.ops.aten._softmax(...)` is a Python call to OpOverloadPacket.__call__: the harness
    names the op when the probe forbids it, and stays silent for ops it does not forbid."""
    import json
    import secrets
    import tempfile

    import numpy as np

    from tfedu.checks.nb00_start_here import PROBES

    probe = PROBES["check_softmax"]
    assert "torch.ops.aten._softmax" in probe.forbidden
    answers = {
        "torch.ops.aten._softmax": "def softmax(x):\n    return torch.ops.aten._softmax(x, -1, False)",
        "torch.ops.aten.softmax.int": "def softmax(x):\n    return torch.ops.aten.softmax.int(x, -1)",
        None: "def softmax(x):\n    e = torch.ops.aten.exp(x - x.amax(-1, keepdim=True))\n    return e / e.sum(-1, keepdim=True)",
    }
    for expected, answer in answers.items():
        namespace = {"__builtins__": __builtins__}
        exec("import torch\n" + answer, namespace)
        folder = Path(tempfile.mkdtemp())
        harness.fresh_out(folder)
        inputs = harness.encode_inputs(probe.make_inputs(np.random.default_rng(0)))
        nonce = secrets.token_hex(4)
        exec(harness.harness_source(folder, probe.run, probe.forbidden, nonce, inputs),
             {"__builtins__": __builtins__, "globals": lambda: namespace})
        result = json.loads((folder / "out" / "result.json").read_text())
        ops = [hit for hit in result["tripwire"] if "torch.ops" in hit]  # (run here, pytest's own processes count too)
        if expected is None:
            assert ops == [] and result["error"] is None, result
        else:
            assert any(expected in hit for hit in ops), result["tripwire"]


HOG_CHECKS = '''
from tfedu.checks.core import Probe, checker, expect

@checker("double")
def check_double(double):
    expect(double(3) == 6, "double(3) should be 6")

PROBES = {"check_double": Probe(exercise="ex_double", make_inputs=lambda rng: {"x": int(rng.integers(0, 99))},
                                run="outputs = {'y': double(inputs['x'])}", reference=lambda inputs: {"y": 2 * inputs["x"]})}
'''
# Trusted cells of the instructor's notebook are not scanned: they stand in for whatever route an answer
# finds past the scan, so this tests the monitor outside the sandbox, not the scan.
HOG_HELPERS = '''import os, signal, time

def spin(n):
    for _ in range(n):
        if os.fork() == 0:
            os.setsid()  # each in a session of its own: the scheduler's autogroups then favour the hog
            while True:
                pass
    time.sleep(30)  # long enough for the monitor's window, however slow the machine

def threads(n):
    import threading
    never = threading.Event()
    for _ in range(n):
        threading.Thread(target=never.wait, daemon=True).start()
    time.sleep(30)

def files(n):
    for i in range(n):
        open(f"/dev/shm/f{i}", "w").close()  # empty: bytes are bounded by the tmpfs size, inodes are not
    time.sleep(30)

def freeze_runner_then_fork(n):
    os.kill(-1, signal.SIGSTOP)  # every process of the sandbox but this one: the runner and its watchdog too
    for _ in range(n):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
'''


@needs_sandbox
@pytest.mark.parametrize("attack,reason,cpus", [
    # a tenth of a core (0.32 with the slack): four spinners in sessions of their own exceed it however loaded
    # the machine is; the other hogs get half a core, which their short bursts of work stay under
    ("spin(4)", "CPU cores", 0.1), ("freeze_runner_then_fork(200)", "processes at once", 0.5),
    ("threads(300)", "threads at once", 0.5), ("files(3000)", "files in one of its private", 0.5)])
def test_the_monitor_outside_the_sandbox_ends_a_hog(tmp_path, monkeypatch, attack, reason, cpus):
    """A run that takes more than its CPU share (slowing the submissions beside it), or holds too many
    processes after freezing the runner's own watchdog, is ended from outside; an honest one is not."""
    import sys
    import time

    from tfedu.course.grading import grade as grade_module

    (tmp_path / "hog_checks.py").write_text(HOG_CHECKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    sys.modules.pop("hog_checks", None)
    source = tmp_path / "93_hog.ipynb"
    nbtools.write(nbtools.new_notebook([
        nbtools.code(HOG_HELPERS),
        nbtools.exercise("ex_double", "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION"),
        nbtools.check("check_double", "from hog_checks import check_double\n\ncheck_double(double)", points=1),
    ]), source)
    entries = {}
    for name, answer in {"hog": f"{attack}\n\ndef double(x):\n    return 2 * x", "honest": "def double(x):\n    return 2 * x"}.items():
        nb = student_version(nbtools.read(source))
        next(c for c in nb.cells if (nbtools.nbgrader_meta(c) or {}).get("grade_id") == "ex_double").source = answer
        path = tmp_path / name / "93_hog.ipynb"
        path.parent.mkdir()
        path.write_text(nbformat.writes(nb))
        started = time.monotonic()
        # the honest run gets a whole core (1.4 with the slack): one busy thread at most stays under it
        entries[name] = grade_module.grade_submission(path, source=source, checks="hog_checks",
                                                      cpus=cpus if name == "hog" else 1.0,
                                                      limits=Limits(cell_timeout=60, timeout=60, threads=200, files=2000))
        entries[name]["wall"] = time.monotonic() - started
    hog, honest = entries["hog"]["exercises"]["check_double"], entries["honest"]["exercises"]["check_double"]
    assert hog["points"] == 0 and reason in hog["feedback"], hog["feedback"]
    assert entries["hog"]["wall"] < 45, entries["hog"]["wall"]  # ended by the monitor, long before the time limit
    assert honest["points"] == 1, honest["feedback"]
    from tfedu.course.grading import warm

    if warm.enabled():  # the monitor found the hog in a kernel forked into the sandbox, not started below bwrap
        assert entries["hog"]["kernel_start"] == entries["honest"]["kernel_start"] == "warm"


def test_the_scan_trusts_self_only_as_a_methods_own_first_parameter():
    """An attribute store (and a getattr with a constant name) is allowed on `self` inside a method; a
    function that merely names its parameter `self` (an outside reviewer's route to os.system), a
    rebound `self`, a computed attribute name even on `self`, and a method taken from its class, where
    any object can stand in for `self` (issue 37's route to the builtins), are flagged."""
    from tfedu.checks.scan import scan_answer

    flagged = {
        "def _get(self, n):\n    return getattr(self, n)\nx = _get(torch, 'sys' + 'tem')": "first parameter of a method",
        "class A:\n    def m(self, n):\n        self = torch\n        return getattr(self, n)": "assign to the name `self`",
        "self = torch\nself.softmax = None": "assign to the name `self`",
        "f = lambda self, n: getattr(self, n)": "first parameter of a method",
        "class A:\n    def m(self, n):\n        return getattr(self, n)": "computed attribute name",
        "class A:\n    def m(self, v):\n        self.allclose = v\nA.m(torch, None)": "take a method from its class (`A.m`)",
        "class A:\n    def m(self, v):\n        self.allclose = v\nclass B(A):\n    pass\nf = B.m": "(`B.m`)",
        "class A:\n    def m(self, v):\n        self.allclose = v\ntype(A()).m(torch, None)": "take a method from its class",
        "class A:\n    def m(self, v):\n        self.allclose = v\nA().__class__.m(torch, None)": "take a method from its class",
    }
    for source, reason in flagged.items():
        assert any(reason in problem for problem in scan_answer("import torch\n" + source)), source
    method = ("class A(torch.nn.Module):\n    def __init__(self, d):\n        super().__init__()\n"
              "        self.w = torch.nn.Linear(d, d)\n        setattr(self, 'bx', 1)\n"
              "    def forward(self, x):\n        return getattr(self, 'w')(x)\n"
              "class B(A):\n    def __init__(self, d):\n        A.__init__(self, d)\n"
              "    def forward(self, x):\n        return type(self).forward(self, x) + A.forward(self, x)")
    assert scan_answer("import torch\n" + method) == []


def test_the_scan_follows_names_to_the_objects_they_name():
    """Issue 37, class 4: a module reached through another (`torch.serialization.os` is `os`), the
    reference re-exported by another module, and the same object under another name are what they
    are, not what they are called."""
    from tfedu.checks.scan import resolve, scan_answer

    assert resolve("torch.serialization.os.fork") == ("os.fork", "posix.fork")
    flagged = {
        "x = torch.serialization.os.memfd_create": "`os.memfd_create` (found `torch.serialization.os.memfd_create`, which is `os.memfd_create`)",
        "from torch.serialization import threading": "`threading`",
        "k = torch.serialization.os.kill": "`os.kill`",
        "w = torch.hub.os.fork": "`os.fork`",
        "from tfedu.layers import attention_weights as w": "uses `tfedu.attention` (what this exercise rebuilds) through "
                                                          "`from tfedu.layers import attention_weights`, which is "
                                                          "`tfedu.attention.attention_weights`",
        "import tfedu.layers as L\nw = L.attention_weights": "which is `tfedu.attention.attention_weights`",
    }
    for source, reason in flagged.items():
        found = scan_answer("import torch\nimport numpy as np\n" + source, forbidden=("tfedu.attention",))
        assert any(reason in problem for problem in found), (source, found)
    same_object = scan_answer("import torch\nf = torch.functional.F.softmax", forbidden=("torch.nn.functional.softmax",))
    assert any("which is `torch.nn.functional.softmax`" in p for p in same_object), same_object
    honest = ("import os\nimport math\nimport torch\nimport numpy as np\nimport torch.nn.functional as F\n"
              "p = os.path.join(os.getcwd(), 'x')\ny = np.emath.sqrt(2.0) + math.inf\nz = F.relu(torch.zeros(2))\n"
              "from tfedu.layers import attention_weights")
    assert scan_answer(honest, forbidden=("tfedu.softmax",)) == []


def test_an_exercise_is_held_to_its_building_blocks_not_to_a_deny_list():
    """Issue 37, class 5: what an answer may use from a library is an allow-list per exercise
    (Probe.builds), so a library's own version of the exercise is refused without anyone naming it,
    while the elementary operations, in torch or NumPy, stay free."""
    from tfedu.checks import nb05_masks_and_heads, nb11_beyond_text
    from tfedu.checks.building_blocks import ELEMENTARY, library_of
    from tfedu.checks.scan import scan_answer

    patchify, mel = nb11_beyond_text.PROBES["check_patchify"], nb11_beyond_text.PROBES["check_mel_filterbank"]
    mha = nb05_masks_and_heads.PROBES["check_multi_head_attention"]
    context = ["import torch\nimport numpy as np\nimport math\nimport torch.nn.functional as F"]

    def problems(answer, probe):
        return scan_answer(answer, context=context, forbidden=probe.forbidden, allowed=probe.builds)

    refused = {
        "def patchify(x, p):\n    return F.pixel_unshuffle(x, p).flatten(2).transpose(1, 2)": "`torch.nn.functional.pixel_unshuffle`",
        "import einops\ndef patchify(x, p):\n    return einops.rearrange(x, 'b c (h p) (w q) -> b (h w) (c p q)', p=p, q=p)":
            "`einops.rearrange`",
        "from numpy.lib.stride_tricks import sliding_window_view as w\ny = w": "`numpy.lib.stride_tricks.sliding_window_view`",
        "import librosa\nbank = librosa.filters.mel(sr=16000, n_fft=400)": "`librosa.filters.mel`",
    }
    for answer, name in refused.items():
        found = problems(answer, patchify if "patchify" in answer or "stride" in answer else mel)
        assert any(name in p and "elementary operations" in p for p in found), (answer, found)
    free = [
        "def patchify(x, p):\n    b, c, h, w = x.shape\n    y = torch.reshape(x, (b, c, h // p, p, w // p, p))\n"
        "    return torch.permute(y, (0, 2, 4, 1, 3, 5)).reshape(b, -1, c * p * p)",
        "def mel_filterbank(n_freqs, n_mels, sr):\n    f = np.linspace(0, sr / 2, n_freqs)\n"
        "    m = 2595 * np.log10(1 + f / 700)\n    return torch.from_numpy(np.maximum(0, np.minimum(m, m)))",
    ]
    for answer in free:
        assert problems(answer, mel) == [], answer
    assert problems("import einops\nq = einops.rearrange", mha) == []  # multi-head attention is about heads, not layout
    # a name the walk cannot follow to its end (a lazily loaded attribute, as librosa's submodules are) is
    # judged by its name, as an unloaded library is
    assert any("`torch.lazily_loaded.mel`" in p for p in problems("y = torch.lazily_loaded.mel(3)", mel))
    assert library_of("math.sqrt") is None and "torch.topk" in ELEMENTARY and "torch.softmax" not in ELEMENTARY


def test_the_harness_reports_a_notebook_thread_but_not_a_librarys(tmp_path):
    """Issue 37, class 3: a thread the notebook started and left running (it could compute an answer out of
    the profiler's sight) trips the hidden test; a library's own thread (tqdm's monitor) does not."""
    import json
    import os
    import sys
    import threading

    from tqdm import tqdm

    def run_probe():
        harness.fresh_out(tmp_path)
        namespace = {"__builtins__": __builtins__}
        exec(harness.harness_source(tmp_path, "outputs = {'y': 1}", (), "n", harness.encode_inputs({"x": 1})),
             {"__builtins__": __builtins__, "globals": lambda: namespace})
        return json.loads((tmp_path / "out" / "result.json").read_text())["tripwire"]

    before = getattr(sys, "tfedu_kernel_threads", None)
    sys.tfedu_kernel_threads = frozenset(sys._current_frames())
    sink = open(os.devnull, "w")
    bar = tqdm(total=2, disable=False, mininterval=60, file=sink)  # starts tqdm's monitor thread
    stop = threading.Event()
    try:
        assert not any("threads" in hit for hit in run_probe())
        scope = {"stop": stop}
        exec(compile("def spin():\n    while not stop.wait(0.01):\n        pass\n", "<a notebook cell>", "exec"), scope)
        worker = threading.Thread(target=scope["spin"], daemon=True)
        worker.start()
        assert any("threads started by the notebook" in hit for hit in run_probe())
    finally:
        stop.set()
        bar.close()
        sink.close()
        if before is None:
            del sys.tfedu_kernel_threads
        else:
            sys.tfedu_kernel_threads = before
