# Correct, but the cell takes most of the per-cell time limit (NEAR_LIMIT_SLEEP is filled in by the test).
import time

time.sleep(NEAR_LIMIT_SLEEP)

def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, stable for large logits."""
    shifted = x - x.max(dim=-1, keepdim=True).values
    exps = shifted.exp()
    return exps / exps.sum(dim=-1, keepdim=True)
