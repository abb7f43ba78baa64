# Does not parse.
def softmax(x) -> :
    return x
