# Shell escape from an IPython cell.
!echo "\N{CHECK MARK} stable softmax: all checks passed"
files = !ls /

def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, stable for large logits."""
    # YOUR CODE HERE
    raise NotImplementedError("replace this line with your code")
