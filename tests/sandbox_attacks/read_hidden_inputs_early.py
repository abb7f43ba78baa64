# Looks for the hidden test's inputs while the answer cell runs, before any tripwire is armed (issue 37,
# class 3): every file under the exchange folder and the other private folders, and any inputs.json read.
_seen = []
for _top in ("/grading", "/tmp", os.path.expanduser("~"), "/dev/shm"):
    for _folder, _dirs, _files in os.walk(_top):
        for _name in _files:
            _seen.append(f"{_folder}/{_name}")
            if _name == "inputs.json":
                with open(f"{_folder}/{_name}") as _handle:
                    _seen.append("read " + _handle.read(200))
_found = [p for p in _seen if p.startswith(("/grading/", "read ")) or p.endswith("inputs.json")]


def softmax(x):
    raise ValueError("ATTACK[found: " + " ; ".join(_found) + "]")
