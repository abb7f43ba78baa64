# Correct, written differently: a helper, a class, float64 arithmetic, logsumexp by hand, a docstring naming softmax.
import math


def _row_max(x):
    return x.max(dim=-1, keepdim=True).values


class _Normaliser:
    """Normalises exp(x - max) so the rows sum to one (a softmax)."""

    def __call__(self, x):
        x64 = x.double()
        log_z = _row_max(x64) + (x64 - _row_max(x64)).exp().sum(dim=-1, keepdim=True).log()
        return (x64 - log_z).exp().to(x.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    assert math.isfinite(1.0)
    return _Normaliser()(x)
