"""The code the grader injects into the student's kernel, and how it reads what comes back.

After each check cell the grader runs one *harness* cell (silently: it is not stored in the
kernel's history and gets no execution count). It

1. loads the probe's inputs, which the grader drew with fresh OS entropy before the run: they travel
   inside this cell's own code (JSON plus ``.npy`` bytes, base64), from the grader's memory through the
   runner's, never as a file, so no cell that ran before it could read them;
2. runs ``Probe.run`` in a namespace copied from the notebook's globals plus ``inputs``, ``np``
   and ``torch``, under a *tripwire*: a profiler (this thread and new threads) that records any
   call into a forbidden module's source file or of a forbidden function object, and a check that
   no forbidden module got imported during the run and that the profiler was not removed; it also
   fires when the run starts a process or when processes of the kernel's session, or Python threads
   the kernel did not start with that run the notebook's own code, are running (a worker that could
   compute the reference out of the profiler's sight; a library's thread, such as tqdm's monitor, is not);
3. converts ``outputs`` (still under the tripwire, with base-class methods so a subclass's
   overrides never run) and writes them as plain data only: JSON for numbers, strings, lists and
   dicts, ``.npy`` (numeric and boolean arrays, saved without pickle) for arrays and tensors. Anything else is an error, so an object with a rigged
   ``__eq__`` never leaves the kernel.

The grader reads the result right after the cell (:func:`read_result`): regular files only (no
symlinks), size limits, ``json.loads`` and ``np.load(allow_pickle=False)``, and the run's nonce
(fresh for each run, so a planted file does not count). It compares the data with the reference
in its own process (:mod:`tfedu.course.grading.grade`). Nothing the kernel says is trusted beyond being data.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

import numpy as np

MAX_RESULT_BYTES = 64 << 20
ARRAY_NAME = re.compile(r"^[0-9]{1,6}\.npy$")

BODY = r'''
def run_in_kernel(folder, code, forbidden, nonce, files, user_namespace):
    import base64, io, json, os, sys, threading
    import numpy as np
    import torch

    def load(node):
        if isinstance(node, dict):
            if set(node) == {"__array__"}:
                return np.load(io.BytesIO(base64.b64decode(files[node["__array__"]])), allow_pickle=False)
            return {key: load(value) for key, value in node.items()}
        if isinstance(node, list):
            return [load(value) for value in node]
        return node

    arrays = []

    def dump(value, depth=0):
        if depth > 32:
            raise TypeError("outputs nest too deeply")
        # Base-class methods called directly, so a subclass's overrides never run here.
        if isinstance(value, torch.Tensor):
            value = torch.Tensor.detach(torch.Tensor.as_subclass(value, torch.Tensor)).cpu()
            value = value.float() if value.dtype in (torch.bfloat16, torch.float16) else value
            value = value.numpy()
        if isinstance(value, np.ndarray):
            value = np.ndarray.view(value, np.ndarray)
            if value.dtype.kind not in "biuf":
                raise TypeError(f"outputs hold an array of dtype {value.dtype}; expected numbers or booleans")
            name = f"{len(arrays)}.npy"
            np.save(os.path.join(folder, "out", name), np.array(value, order="C"), allow_pickle=False)  # keeps 0-d arrays 0-d
            arrays.append(name)
            return {"__array__": name}
        if isinstance(value, np.generic) and type(value).__module__ == "numpy":
            value = value.item()
        if value is None or type(value) in (bool, int, float, str):
            return value
        if type(value) in (list, tuple):
            return [dump(item, depth + 1) for item in value]
        if type(value) is dict:
            return {str(key): dump(item, depth + 1) for key, item in value.items()}
        raise TypeError(f"outputs must be plain data (numbers, strings, lists, dicts, arrays), got {type(value).__name__}")

    inputs = load(json.loads(base64.b64decode(files["inputs.json"])))
    files = None
    namespace = dict(user_namespace)
    namespace.update(inputs=inputs, np=np, torch=torch)

    files, objects, methods, hits, torch_ops = set(), {}, [], [], set()
    for name in forbidden:
        if name.startswith("torch.ops.") and name.count(".") in (2, 3):
            # torch.ops.aten (every op of the namespace) or torch.ops.aten._softmax (one op, any overload)
            torch_ops.add(tuple(name.split(".")[2:]))
            continue
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            files.add(os.path.realpath(module.__file__))
            continue
        try:  # not imported yet: watch its file all the same, in case the run imports it
            import importlib.util
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin and os.path.isfile(spec.origin):
                files.add(os.path.realpath(spec.origin))
                continue
        except (ImportError, ValueError, AttributeError):
            pass
        parts, target = name.split("."), None  # a function, class attribute or method: walk from its module
        for cut in range(len(parts) - 1, 0, -1):
            owner = sys.modules.get(".".join(parts[:cut]))
            if owner is not None:
                try:
                    target = owner
                    for attr in parts[cut:]:
                        target = getattr(target, attr)
                except AttributeError:
                    target = None
                break
        if target is not None:
            objects[id(getattr(target, "__code__", target))] = name
            if getattr(target, "__objclass__", None) is not None:  # a C method such as torch.Tensor.softmax
                methods.append((target.__objclass__, getattr(target, "__name__", ""), name))
    loaded_before = {name for name in forbidden if name in sys.modules}

    seen = {}
    spawners = {"fork", "forkpty", "fork_exec", "posix_spawn", "posix_spawnp", "system", "execv", "execve", "spawnv", "spawnve", "vfork"}

    def watch(frame, event, arg):
        if event == "call":
            code_obj = frame.f_code
            where = code_obj.co_filename
            if where not in seen:
                seen[where] = bool(files) and os.path.realpath(where) in files
            if id(code_obj) in objects or seen[where]:
                hits.append(f"{code_obj.co_name} from {os.path.basename(code_obj.co_filename)}")
            elif torch_ops and code_obj.co_name == "__call__" and where.endswith("_ops.py"):
                # torch.ops.aten.add(...) and torch.ops.aten.add.Tensor(...) run OpOverloadPacket/OpOverload.__call__
                op = frame.f_locals.get("self")
                space, _, rest = str(getattr(op, "_qualified_op_name", "") or getattr(op, "_name", "")).partition("::")
                if (space,) in torch_ops or (space, rest.split(".")[0]) in torch_ops:
                    hits.append(f"torch.ops.{space}.{rest}")
        elif event == "c_call":
            if id(arg) in objects:
                hits.append(objects[id(arg)])
            elif methods and any(getattr(arg, "__name__", None) == method and isinstance(getattr(arg, "__self__", None), owner)
                                 for owner, method, _ in methods):
                hits.extend(label for owner, method, label in methods if getattr(arg, "__name__", None) == method)
            elif getattr(arg, "__name__", "") in spawners and getattr(arg, "__module__", "") in ("posix", "_posixsubprocess", "os", "nt"):
                hits.append(f"it started a process ({arg.__name__}) while being tested")

    def others():  # processes in the kernel's session other than the kernel, its launcher and the grader's runner
        found = []
        try:
            me, launcher, session = os.getpid(), os.getppid(), os.getsid(0)
            try:
                with open(f"/proc/{launcher}/stat", "rb") as handle:
                    runner = int(handle.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                runner = -1
            for entry in os.listdir("/proc"):
                if entry.isdigit() and int(entry) not in (me, launcher, runner):
                    try:
                        if os.getsid(int(entry)) == session:
                            found.append(int(entry))
                    except OSError:
                        pass
        except OSError:
            pass
        return found

    if others():
        hits.append("processes started by the notebook were still running when the hidden test began")
    def runs_notebook_code(frame):  # a cell's code or a string's, not a library's file (tqdm's monitor, say)
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith("<") or not os.path.isfile(name):
                return True
            frame = frame.f_back
        return False

    baseline = getattr(sys, "tfedu_kernel_threads", None)
    if baseline is not None and any(runs_notebook_code(frame) for ident, frame in sys._current_frames().items()
                                     if ident not in baseline and ident != threading.get_ident()):
        hits.append("threads started by the notebook were still running when the hidden test began")
    error = None
    threading.setprofile(watch)
    sys.setprofile(watch)
    dumped = None
    try:  # converting the outputs stays under watch too: it may run the answer's own methods
        exec(compile(code, "<string>", "exec"), namespace)
        dumped = dump(namespace.get("outputs"))
    except BaseException as err:
        error = f"{type(err).__name__}: {err}"[:2000]
    finally:
        intact = sys.getprofile() is watch
        sys.setprofile(None)
        threading.setprofile(None)
    tripwire = sorted(set(hits))[:5]
    if not intact:
        tripwire.append("the profiler that watches for the reference was removed")
    if others():
        tripwire.append("it left processes running after the hidden test")
    tripwire += [f"{name} was imported" for name in forbidden if name in sys.modules and name not in loaded_before]
    result = {"error": error, "tripwire": tripwire, "outputs": dumped, "nonce": nonce}
    with open(os.path.join(folder, "out", "result.json"), "w") as handle:
        json.dump(result, handle)

'''


# Run silently once in each fresh kernel, before any cell: the Python threads the kernel itself runs. (On
# ``sys``, which an answer may not reach: the static scan allows only a few of its attributes.)
THREADS_BASELINE = "exec('import sys\\nsys.tfedu_kernel_threads = frozenset(sys._current_frames())', {})"

STANDINS_BODY = r'''
def swap(source, user_namespace, stash):
    if source is None:  # put the learner's own objects back
        names, saved = user_namespace.pop(stash, ((), {}))
        for name in names:
            if name in saved:
                user_namespace[name] = saved[name]
            else:
                user_namespace.pop(name, None)
        return
    import math
    import numpy as np
    import torch
    import torch.nn.functional as F
    given = {"torch": torch, "np": np, "math": math, "F": F}
    scope = dict(given, __name__="tfedu_standins")
    exec(compile(source, "<tfedu stand-ins>", "exec"), scope)
    # tfedu.checks.core.standin_objects in the kernel: public names only (an underscore marks a private helper)
    names = [name for name in scope if not name.startswith("_") and (name not in given or scope[name] is not given[name])]
    user_namespace[stash] = (names, {name: user_namespace[name] for name in names if name in user_namespace})
    for name in names:
        user_namespace[name] = scope[name]

'''
STANDIN_STASH = "_tfedu_learner_objects"


def standin_sources(standins: str) -> tuple[str, str]:
    """Two silent cells: bind the reference stand-ins for earlier exercises in the notebook's globals, and undo it.

    The grader runs the first before an exercise's check cell and the second after its hidden
    test, so a mistake in an earlier exercise (the stand-ins replace its objects by name) cannot
    cost this one its marks: one mistake costs one exercise.
    """
    def cell(source: str | None) -> str:
        call = f"swap({source!r}, user_namespace, {STANDIN_STASH!r})"
        return f"exec({STANDINS_BODY + call!r}, {{'__builtins__': __builtins__, 'user_namespace': globals()}})"

    return cell(standins), cell(None)


def harness_source(folder: str | Path, code: str, forbidden: tuple[str, ...], nonce: str, inputs: dict[str, str]) -> str:
    """The harness cell for one probe: its inputs (:func:`encode_inputs`) inside it, its result written to ``folder``/out.

    The helper is defined in a private namespace (not the notebook's globals) and called with the
    notebook's globals, so the code under test sees no new names while it runs. ``nonce`` (fresh
    for each run, known to the kernel only from this cell) must come back in the result, so a
    result file planted earlier is not mistaken for this run's.
    """
    call = f"run_in_kernel({str(folder)!r}, {code!r}, {tuple(forbidden)!r}, {nonce!r}, {inputs!r}, user_namespace)"
    return f"exec({BODY + call!r}, {{'__builtins__': __builtins__, 'user_namespace': globals()}})"


def _encode(value: Any, arrays: dict[str, bytes]) -> Any:
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"probe inputs may only hold numeric or boolean arrays, got {value.dtype}")
        name = f"{len(arrays)}.npy"
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        arrays[name] = buffer.getvalue()
        return {"__array__": name}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _encode(v, arrays) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v, arrays) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"probe inputs must be plain data, got {type(value).__name__}")


def encode_inputs(inputs: dict[str, Any]) -> dict[str, str]:
    """One probe run's inputs as plain text: ``inputs.json`` (the tree, arrays by name) and ``N.npy``, base64.

    The grader puts them in the plan, which reaches the runner on its stdin; the runner hands them to
    the kernel inside the probe's harness cell (:func:`harness_source`), so they never exist in a file
    and no cell that runs before the hidden test can read them.
    """
    arrays: dict[str, bytes] = {}
    files = {"inputs.json": json.dumps(_encode(inputs, arrays)).encode("utf-8"), **arrays}
    return {name: base64.b64encode(data).decode("ascii") for name, data in files.items()}


def fresh_out(folder: Path) -> None:
    """An empty ``folder``/out for one harness run, whatever was left or planted there (a file, a symlink, a tree)."""
    folder.mkdir(mode=0o700, exist_ok=True)
    out = folder / "out"
    if out.is_symlink() or out.is_file():
        out.unlink()
    elif out.exists():
        shutil.rmtree(out)
    out.mkdir(mode=0o700)


def _read_regular(path: Path, limit: int) -> bytes:
    """The bytes of a regular file that is not a symlink, at most ``limit`` of them."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise ValueError(f"{path.name} is not a regular file of at most {limit} bytes")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read(limit + 1)
    finally:
        os.close(fd)


def read_result(folder: Path, nonce: str) -> dict[str, Any] | None:
    """What the harness wrote for the run with ``nonce``, as plain data; None when nothing usable came back."""
    out = folder / "out"
    try:
        if out.is_symlink() or not out.is_dir():
            return None
        raw = json.loads(_read_regular(out / "result.json", MAX_RESULT_BYTES).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(raw, dict) or raw.get("nonce") != nonce:
        return None
    budget = [MAX_RESULT_BYTES]

    def load(node: Any, depth: int = 0) -> Any:
        if depth > 40:
            raise ValueError("nested too deeply")
        if isinstance(node, dict):
            if set(node) == {"__array__"}:
                name = node["__array__"]
                if not isinstance(name, str) or not ARRAY_NAME.match(name):
                    raise ValueError("bad array reference")
                data = _read_regular(out / name, budget[0])
                budget[0] -= len(data)
                array = np.load(io.BytesIO(data), allow_pickle=False)
                if array.dtype.kind not in "biuf":
                    raise ValueError(f"array of dtype {array.dtype}")
                return array
            return {str(k): load(v, depth + 1) for k, v in node.items()}
        if isinstance(node, list):
            return [load(v, depth + 1) for v in node]
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise ValueError(f"unexpected {type(node).__name__}")

    try:
        error = raw.get("error")
        tripwire = raw.get("tripwire") or []
        return {
            "error": str(error)[:2000] if error is not None else None,
            "tripwire": [str(t)[:300] for t in tripwire][:10] if isinstance(tripwire, list) else ["malformed tripwire report"],
            "outputs": load(raw.get("outputs")),
        }
    except (OSError, ValueError, RecursionError) as err:
        return {"error": f"the outputs could not be read back as plain data ({err})", "tripwire": [], "outputs": None}
