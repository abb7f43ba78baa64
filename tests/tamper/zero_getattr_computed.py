# getattr on the package with a computed name.
import tfedu
import importlib as _unused_name_check  # noqa


def softmax(x):
    return getattr(tfedu, "".join(reversed("xamtfos"))).softmax(x)
