# Returns plain nested lists of the right shape but wrong values.
def softmax(x):
    return [[0.0] * x.shape[-1] for _ in range(x.shape[0])]
