# A line magic that runs Python from a file.
%run -i /dev/null

def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, stable for large logits."""
    # YOUR CODE HERE
    raise NotImplementedError("replace this line with your code")
