# Reads stdin directly (there is none: it is /dev/null), then a wrong answer.
with open("/dev/stdin") as handle:
    data = handle.read()

def softmax(x: torch.Tensor) -> torch.Tensor:
    return x.exp() / x.exp().sum(dim=-1, keepdim=True)
