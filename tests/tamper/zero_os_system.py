# os.system and os.popen.
import os

os.system("echo passed")
out = os.popen("echo passed").read()

def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, stable for large logits."""
    # YOUR CODE HERE
    raise NotImplementedError("replace this line with your code")
