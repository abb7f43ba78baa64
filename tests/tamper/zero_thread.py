# A background thread that keeps overwriting things.
import threading


def _meddle():
    while True:
        globals()["softmax"] = lambda x: x


threading.Thread(target=_meddle, daemon=True).start()

def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, stable for large logits."""
    # YOUR CODE HERE
    raise NotImplementedError("replace this line with your code")
