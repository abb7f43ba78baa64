# Writes outside the exercise folder through four routes the scan does not treat as writing: an aliased
# `open`, `Path.open` with a computed mode, `ndarray.dump` and `os.open` past the scan; into the
# submissions folder, another submission, the results, the instructor's decoy, the course package, the
# host's /tmp and home. Then fails on purpose, with what it managed.
from pathlib import Path

from attack_routes import os as _os

_w = open
_mode = "w" + ""
_seen = []
for _path in {{WRITE_TARGETS}}:
    for _route in ("open", "path", "dump", "os.open"):
        _target = _path if _path.endswith((".ipynb", ".json", ".csv", ".txt")) else f"{_path}-{_route}"
        try:
            if _route == "open":
                with _w(_target, "a") as _f:
                    _f.write("HACKED")
            elif _route == "path":
                with Path(_target).open(_mode.replace("w", "a")) as _f:
                    _f.write("HACKED")
            elif _route == "dump":
                np.zeros(3).dump(_target)
            else:
                _fd = _os.open(_target, _os.O_WRONLY | _os.O_CREAT | _os.O_APPEND)
                _os.write(_fd, b"HACKED")
                _os.close(_fd)
            _seen.append(f"{_target} by {_route}: written")
        except OSError as _err:
            _seen.append(f"{_target} by {_route}: {type(_err).__name__}")


def softmax(x):
    raise ValueError("ATTACK[" + " ; ".join(_seen) + "]")
