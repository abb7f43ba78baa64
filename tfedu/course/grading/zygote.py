"""The warm-kernel server: a process that imports torch, numpy and ipykernel once, outside every sandbox, and
forks each submission's first kernel straight into that submission's sandbox (:mod:`tfedu.course.grading.warm`
starts it and talks to it; read that module's docstring for the design and what it keeps of the sandbox's promises).

Run as a script, never imported: ``python -P zygote.py`` with the runner's environment, its standard input and
output pipes to the grader. The first line it reads is its set-up (the seccomp filter, the launcher, what to
import); it answers ``ready``. Then each line is one request, answered with one line:

    {"pid": RUNNER, "cgroup": FOLDER or null, "limits": [AS, FSIZE, CPU, NPROC], "env": {...}, "rendezvous": PATH}
    -> {"ok": true} | {"ok": false, "stage": WHERE}

For a request it forks a child that, from outside, joins the runner's cgroup and every namespace of the
runner's sandbox, takes the runner's identity inside, drops every capability, sets no_new_privs and the
sandbox's seccomp filter, and forks the launcher inside the sandbox's PID namespace, then exits. The launcher
checks itself against the runner (the same user and groups, no capability, the same seccomp and namespaces and
cgroup) and refuses to start a kernel when anything differs. Only then does it read the rendezvous file the runner
wrote (the connection file and working folder), start the kernel (forked, not executed) and supervise it
exactly as :data:`tfedu.course.grading.kernel.LAUNCHER` does for a cold kernel.

Nothing of the grader's reaches it: no plan, no hidden input, no result, no open file (the grader starts it with
``close_fds``); it holds only what it imported and the request it serves.
"""

import ctypes
import json
import os
import struct
import sys
import time

NAMESPACES = ("cgroup", "ipc", "uts", "net", "pid", "mnt")  # the user namespace is joined last
COMPARED = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp",
            "Seccomp_filters")
NOBODY = 65534
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 22, 2, 38, 24
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
WAIT_FOR_RUNNER = 60.0  # seconds the launcher waits for the runner's rendezvous file

libc = ctypes.CDLL(None, use_errno=True)


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def status(path):
    fields = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in COMPARED:
                fields[key] = value.split()
    return fields


def must(ok, stage):
    if not ok:
        os._exit(stage)


def enter(request, seccomp):
    """In the forked child, outside: become a process of the runner's sandbox. Exits with a stage number on failure."""
    pid = int(request["pid"])
    os.closerange(3, max(1 << 16, os.sysconf("SC_OPEN_MAX")))  # close_range(2) where there is one
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    try:
        inner = int(open(f"/proc/{pid}/status").read().split("NSpid:")[1].split("\n")[0].split()[-1])
        expected_ns = {n: os.readlink(f"/proc/{pid}/ns/{n}") for n in (*NAMESPACES, "user")}
        fds = {n: os.open(f"/proc/{pid}/ns/{n}", os.O_RDONLY) for n in (*NAMESPACES, "user")}
    except (OSError, IndexError, ValueError):
        os._exit(10)
    if request.get("cgroup"):
        try:
            with open(os.path.join(request["cgroup"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            os._exit(11)
    if os.geteuid() == 0:
        os.setgroups([])
    for name in NAMESPACES:
        must(libc.setns(fds[name], 0) == 0, 12)
        os.close(fds[name])
    must(libc.setns(fds["user"], 0) == 0, 12)
    os.close(fds["user"])
    try:
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    except OSError:
        os._exit(13)
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: past the last one
            os._exit(14)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header, data = CapHeader(0x20080522, 0), (CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3, all zero
    must(libc.capset(ctypes.byref(header), data) == 0, 15)
    must(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, 16)
    program = ctypes.create_string_buffer(seccomp)
    fprog = SockFprog(len(seccomp) // 8, ctypes.cast(program, ctypes.c_void_p))
    must(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0, 17)
    if os.fork() != 0:  # only a child is in the sandbox's PID namespace; it is re-parented to the sandbox's init
        os._exit(0)
    launch(request, inner, expected_ns)


def launch(request, runner, expected_ns):
    """Inside the sandbox: check this process against the runner, then start and supervise the kernel."""
    os.setsid()
    rendezvous = request["rendezvous"]
    deadline = time.monotonic() + WAIT_FOR_RUNNER
    while not os.path.exists(rendezvous):
        if time.monotonic() > deadline:
            os._exit(20)
        time.sleep(0.005)
    with open(rendezvous) as f:
        meeting = json.load(f)
    answer = meeting["answer"]

    def reply(**fields):
        with open(answer + ".part", "w") as f:
            json.dump(fields, f)
        os.rename(answer + ".part", answer)

    problems = [key for key, value in status(f"/proc/{runner}/status").items() if status("/proc/self/status").get(key) != value]
    problems += [f"{n} namespace" for n in expected_ns if os.readlink(f"/proc/self/ns/{n}") != expected_ns[n]]
    try:
        if open(f"/proc/{runner}/cgroup").read() != open("/proc/self/cgroup").read():
            problems.append("cgroup")
    except OSError:
        problems.append("cgroup")
    if problems:
        reply(refused="differs from the runner: " + ", ".join(problems))
        os._exit(21)
    os.chdir(meeting["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ["PWD"] = meeting["cwd"]
    reply(pid=os.getpid())
    exit_file = answer + ".exit"

    def start_kernel():
        import ipykernel_launcher

        for module in ("numpy", "torch"):  # a fresh process draws fresh seeds; a fork shares its parent's
            if module in sys.modules:
                getattr(sys.modules[module].random, "seed")()
        sys.argv = [ipykernel_launcher.__file__, "-f", meeting["connection_file"], *request["kernel_args"]]
        from ipykernel import kernelapp

        kernelapp.launch_new_instance(argv=sys.argv[1:])
        os._exit(0)

    def report_exit(code):
        try:
            with open(exit_file, "w") as f:
                f.write(str(code))
        except OSError:
            pass

    sys.argv = ["-c", *(str(int(v)) for v in request["limits"])]
    exec(request["launcher"], {"__name__": "__main__", "start_kernel": start_kernel, "report_exit": report_exit})


def serve():
    setup = json.loads(sys.stdin.readline())
    import base64
    import importlib

    import tempfile

    for module in setup["preload"]:
        importlib.import_module(module)
    # A preloaded library may have asked for the temporary folder (dill does, when torch imports it): tempfile
    # caches the answer, which is this server's private /var/tmp. Forget it, so that each kernel finds its
    # own sandbox's temporary folder the first time it asks.
    tempfile.tempdir = None
    seccomp = base64.b64decode(setup["seccomp"])
    assert len(seccomp) % 8 == 0 and struct.calcsize("=HBBI") == 8
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        request = json.loads(line)
        request["launcher"] = setup["launcher"]
        request["kernel_args"] = setup["kernel_args"]
        child = os.fork()
        if child == 0:
            try:
                enter(request, seccomp)
            finally:
                os._exit(9)
        _, code = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(code)
        sys.stdout.write(json.dumps({"ok": code == 0, "stage": code}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
