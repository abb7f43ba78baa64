# Reaches torch's softmax through a module that happens to hold torch.nn.functional under another name
# (issue 37, class 4): the names differ, the object is the same.
from torch.functional import F as _maths


def softmax(x):
    return _maths.softmax(x, dim=-1)
