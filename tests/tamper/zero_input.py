# Waits for input.
answer = input("which softmax? ")

def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, stable for large logits."""
    shifted = x - x.max(dim=-1, keepdim=True).values
    exps = shifted.exp()
    return exps / exps.sum(dim=-1, keepdim=True)
