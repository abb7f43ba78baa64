# Stops the notebook with sys.exit.
import sys

def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, stable for large logits."""
    # YOUR CODE HERE
    raise NotImplementedError("replace this line with your code")

sys.exit(0)
