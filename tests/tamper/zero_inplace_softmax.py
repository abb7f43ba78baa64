# Wrong: right values, but the caller's tensor is shifted in place (found by an outside reviewer, scored 2/2).
def softmax(x: torch.Tensor) -> torch.Tensor:
    x -= x.max(dim=-1, keepdim=True).values
    e = x.exp()
    return e / e.sum(dim=-1, keepdim=True)
