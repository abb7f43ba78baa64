# Asks torch for a terabyte inside the function.
def softmax(x):
    big = torch.ones(1 << 38)
    return x / big.sum()
