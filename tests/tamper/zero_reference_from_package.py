# from tfedu import softmax (the module), used inside the function.
from tfedu import softmax as sm


def softmax(x):
    return sm.softmax(x)
