# torch.load of bytes assembled at run time (no pickle import): the loader can call anything by name.
import io

import torch

blob = bytes([128, 4, 75, 0, 46])


def softmax(x):
    torch.load(io.BytesIO(blob), weights_only=False)
    return x
