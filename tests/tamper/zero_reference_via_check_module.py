# Calls the reference through the checks module that the check cell binds to `checks` (no import here,
# so no static scan can see it; the runtime tripwire must).
def softmax(x: torch.Tensor) -> torch.Tensor:
    return checks.reference_softmax(x)
