# Correct, but it warns and writes to stderr at definition time and on every call.
import sys
import warnings

print("note: defining softmax", file=sys.stderr)


def softmax(x: torch.Tensor) -> torch.Tensor:
    warnings.warn("softmax: this is only a friendly warning", UserWarning)
    print("softmax called", file=sys.stderr)
    shifted = x - x.max(dim=-1, keepdim=True).values
    exps = shifted.exp()
    return exps / exps.sum(dim=-1, keepdim=True)
