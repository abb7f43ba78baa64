# getattr chains with constant names.
import tfedu

softmax = getattr(getattr(tfedu, "softmax"), "softmax")
