# Calls torch's internal C softmax (private API) instead of building it.
def softmax(x):
    return torch._C._VariableFunctions._softmax(x, -1, False)
