# A correct answer that also writes a file outside its folder with io.FileIO and makes a folder.
import io
from pathlib import Path

_f = io.FileIO("/tmp/tfedu_tamper_fileio.txt", "w")
_f.write(b"written by an answer cell")
_f.close()
Path("/tmp/tfedu_tamper_dir").mkdir(exist_ok=True)


def softmax(x):
    e = (x - x.max(dim=-1, keepdim=True).values).exp()
    return e / e.sum(dim=-1, keepdim=True)
