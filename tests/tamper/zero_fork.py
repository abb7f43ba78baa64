# Forks a child that lives on.
import os
import time

if os.fork() == 0:
    time.sleep(10**6)

def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, stable for large logits."""
    # YOUR CODE HERE
    raise NotImplementedError("replace this line with your code")
