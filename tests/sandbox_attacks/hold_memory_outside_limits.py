# Takes memory that no per-process limit counts (issue 37, class 6): anonymous files (memfd_create), SysV
# shared memory, and reports the open-file limit that bounds how many such things a process can hold.
from attack_routes import ctypes as _ctypes, os as _os, resource as _resource

_seen = []
try:
    _fds = []
    for _i in range(4):
        _fd = _os.memfd_create(f"tfedu-attack-{_i}")
        _os.ftruncate(_fd, 64 << 20)
        _os.pwrite(_fd, b"x" * (1 << 20), 0)
        _fds.append(_fd)
    _seen.append(f"memfd_create: held {len(_fds)} x 64 MiB")
except OSError as _err:
    _seen.append(f"memfd_create: errno {_err.errno}")
_libc = _ctypes.CDLL(None, use_errno=True)
_id = _libc.shmget(0, 64 << 20, 0o1600)
_seen.append(f"shmget: {'errno ' + str(_ctypes.get_errno()) if _id < 0 else 'segment ' + str(_id)}")
_seen.append(f"open files: {_resource.getrlimit(_resource.RLIMIT_NOFILE)}")


def softmax(x):
    raise ValueError("ATTACK[" + " ; ".join(_seen) + "]")
