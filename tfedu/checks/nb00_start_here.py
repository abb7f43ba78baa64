"""Checkers for notebooks/00_start_here.ipynb."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tfedu.checks.core import CheckFailure, Probe, call_learner, checker, compare, seeded_randn, watch_calls
from tfedu.softmax import softmax as reference_softmax

SHAPE_HINT = (
    "x.max(dim=-1) returns (values, indices): take .values; and pass keepdim=True to max and sum "
    "so the (rows, 1) result broadcasts against x"
)


def naive_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x.exp() / x.exp().sum(dim=dim, keepdim=True)


# What the exercise rules out: the reference, and every ready-made softmax or log-softmax
# (exp(log_softmax(x)) is the softmax with extra steps).
SOFTMAX_SHORTCUTS = (
    "tfedu.softmax", "torch.softmax", "torch.Tensor.softmax", "torch.nn.functional.softmax", "torch.special.softmax",
    "torch.log_softmax", "torch.Tensor.log_softmax", "torch.nn.functional.log_softmax", "torch.special.log_softmax",
    "torch.nn.Softmax", "torch.nn.LogSoftmax", "scipy.special.softmax", "scipy.special.log_softmax",
)


def learner_softmax(softmax, x: torch.Tensor) -> torch.Tensor:
    """Call the learner's softmax, refusing torch's own (the exercise is to build it)."""
    watched = [(torch, "softmax"), (F, "softmax"), (torch.Tensor, "softmax"), (torch, "log_softmax"),
               (F, "log_softmax"), (torch.Tensor, "log_softmax"), (torch.special, "softmax"), (torch.special, "log_softmax")]
    with watch_calls(*watched) as called:
        out = call_learner(softmax, x, name="softmax", error_hint=SHAPE_HINT)
    if called:
        raise CheckFailure(f"you called {called[0]}; build the softmax yourself from max, exp and sum")
    return out


@checker("stable softmax")
def check_softmax(softmax) -> None:
    """Check a learner's ``softmax(x)`` over the last dimension."""
    x = seeded_randn(0, 4, 7)
    shifted = (x - x.amax(dim=-1, keepdim=True)).exp()
    compare(
        learner_softmax(softmax, x),
        reference_softmax(x),
        what="softmax(x)",
        mistakes={
            "you normalised over dim 0 (down the columns); a softmax over logits normalises the last dim, dim=-1": reference_softmax(x, dim=0),
            "rows do not sum to one: divide exp(x) by the sum of exp(x) along the same dim (keepdim=True), not the sum of everything": x.exp() / x.exp().sum(),
            "rows do not sum to one: after subtracting the max, divide by the sum along dim=-1 (keepdim=True), not the sum of everything": shifted / shifted.sum(),
            "you returned exp(x) without dividing by the row sum": x.exp(),
            "you returned exp(x - max) without dividing by the row sum": shifted,
        },
    )
    # Large logits overflow exp; rows with a wide spread catch shifts by anything but the max
    # (the min, the mean or the first entry all leave exp(1000) in the row).
    big = torch.tensor([[1000.0, 1001.0, 1002.0], [-1000.0, -1000.0, -999.0], [0.0, 500.0, 1000.0], [-1000.0, 0.0, 3.0]])
    compare(
        learner_softmax(softmax, big),
        reference_softmax(big),
        what="softmax of large logits",
        nan_hint=(
            "NaN or Inf for large logits like [1000, 1001, 1002] or [0, 500, 1000]: exp(1000) overflows float32. "
            "Subtract the row max (x - x.max(dim=-1, keepdim=True).values) before exp: "
            "not the min, the mean or the first entry"
        ),
    )
    batched = seeded_randn(1, 2, 3, 5)
    compare(learner_softmax(softmax, batched), reference_softmax(batched), what="softmax of a (2, 3, 5) batch",
            mistakes={"wrong axis on a 3-D batch: normalise dim=-1, not dim=1": reference_softmax(batched, dim=1)})


def _softmax_inputs(rng: np.random.Generator) -> dict:
    x = rng.standard_normal((4, int(rng.integers(2, 9)))).astype(np.float32) * 5
    x[0] += 1000.0  # overflow bait
    x[1, 0] = 1000.0  # a wide spread: only the max shift survives it
    x[2, -1] = -1000.0
    x[3, -1] = 1000.0  # large last entry: a shift by the first entry overflows
    return {"x": x}


PROBES = {
    "check_softmax": Probe(
        exercise="ex_softmax",
        make_inputs=_softmax_inputs,
        run="outputs = {'y': softmax(torch.from_numpy(inputs['x'])).detach().cpu().numpy()}",
        reference=lambda inputs: {"y": reference_softmax(torch.from_numpy(inputs["x"])).numpy()},
        # The exercise is to build the softmax: the reference and torch's own versions are off limits.
        forbidden=SOFTMAX_SHORTCUTS,
    ),
}
