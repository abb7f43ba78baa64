"""Checkers for notebooks/00_start_here.ipynb."""

from __future__ import annotations

import numpy as np
import torch

from tfedu.checks.core import Probe, call_learner, checker, compare, seeded_randn
from tfedu.softmax import softmax as reference_softmax


def naive_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x.exp() / x.exp().sum(dim=dim, keepdim=True)


@checker("stable softmax")
def check_softmax(softmax) -> None:
    """Check a learner's ``softmax(x)`` over the last dimension."""
    x = seeded_randn(0, 4, 7)
    compare(
        call_learner(softmax, x, name="softmax"),
        reference_softmax(x),
        what="softmax(x)",
        mistakes={
            "you normalised over dim 0 (down the columns); a softmax over logits normalises the last dim, dim=-1": torch.softmax(x, dim=0),
            "rows do not sum to one: divide exp(x) by the sum of exp(x) along the same dim (keepdim=True)": x.exp() / x.exp().sum(),
            "you returned exp(x) without dividing by the row sum": x.exp(),
        },
    )
    big = torch.tensor([[1000.0, 1001.0, 1002.0], [-1000.0, -1000.0, -999.0]])
    compare(
        call_learner(softmax, big, name="softmax"),
        reference_softmax(big),
        what="softmax of large logits",
        nan_hint=(
            "NaN or Inf for large logits like [1000, 1001, 1002]: exp(1000) overflows float32. "
            "Subtract the row max (x - x.max(dim=-1, keepdim=True).values) before exp"
        ),
    )
    batched = seeded_randn(1, 2, 3, 5)
    compare(call_learner(softmax, batched, name="softmax"), reference_softmax(batched), what="softmax of a (2, 3, 5) batch",
            mistakes={"wrong axis on a 3-D batch: normalise dim=-1, not dim=1": torch.softmax(batched, dim=1)})


def _softmax_inputs(rng: np.random.Generator) -> dict:
    x = rng.standard_normal((3, int(rng.integers(2, 9)))).astype(np.float32) * 5
    x[0] += 1000.0  # overflow bait
    return {"x": x}


PROBES = {
    "check_softmax": Probe(
        exercise="ex_softmax",
        make_inputs=_softmax_inputs,
        run="outputs = {'y': softmax(torch.from_numpy(inputs['x'])).detach().cpu().numpy()}",
        reference=lambda inputs: {"y": reference_softmax(torch.from_numpy(inputs["x"])).numpy()},
        forbidden=("tfedu.softmax",),
    ),
}
