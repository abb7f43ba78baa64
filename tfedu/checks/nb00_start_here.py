"""Checkers for notebooks/00_start_here.ipynb."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tfedu.checks.core import CheckFailure, Hints, Probe, call_learner, checker, compare, seeded_randn, watch_calls
from tfedu.checks.probes import CLEANUP, HELPERS, HINT_MUTATED, as_array, backward, compare_outputs, leaf, upstream_like
from tfedu.softmax import softmax as reference_softmax

SHAPE_HINT = (
    "a max over one dim returns a pair (values, indices): take .values; and pass keepdim=True to max and sum "
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
    # the same kernels by other doors: sparse tensors and the private entry points
    "torch.sparse.softmax", "torch.sparse.log_softmax", "torch._softmax", "torch._log_softmax",
    # and as operators (the static scan refuses torch.ops; this is what the run-time tripwire watches)
    "torch.ops.aten._softmax", "torch.ops.aten.softmax", "torch.ops.aten._log_softmax", "torch.ops.aten.log_softmax",
    "torch.ops.aten._sparse_softmax", "torch.ops.aten._safe_softmax",
)


def learner_softmax(softmax, x: torch.Tensor) -> torch.Tensor:
    """Call the learner's softmax, refusing torch's own (the exercise is to build it)."""
    watched = [(torch, "softmax"), (F, "softmax"), (torch.Tensor, "softmax"), (torch, "log_softmax"),
               (F, "log_softmax"), (torch.Tensor, "log_softmax"), (torch.special, "softmax"), (torch.special, "log_softmax")]
    given = x.clone()
    with watch_calls(*watched) as called:
        out = call_learner(softmax, given, name="softmax", error_hint=SHAPE_HINT)
    if called:
        raise CheckFailure(f"you called {called[0]}; build the softmax yourself from max, exp and sum")
    if not torch.equal(given, x):
        raise CheckFailure(HINT_MUTATED.format(function="softmax", positions="1"))
    return out


def _where(d: int | str, ndim: int, *, columns: str = "one per column") -> str:
    """Words for the dim a max, min, mean or sum ran over."""
    if d == "all":
        return "of the whole tensor"
    if d == ndim - 1:
        return "over the last dim"
    return f"over dim 0 ({columns})" if ndim == 2 else f"over dim {d}"


def _shift_words(kind: str, d: int | str, ndim: int) -> str:
    if d == ndim - 1:
        return f"each row's {'first entry' if kind == 'first' else kind}"
    if kind == "first":
        return "the first row (one number per column)" if ndim == 2 else f"the first entry along dim {d}"
    return f"the {kind} {_where(d, ndim)}"


def _slip_hint(kind: str | None, shift_dim: int | str | None, sum_dim: int | str | None, ndim: int) -> str | None:
    """The hint for a softmax built as exp(x - shift) / sum with the shift or the sum on a wrong dim.

    ``kind`` is "max", "min", "mean", "first" or None (no shift); ``shift_dim`` and ``sum_dim``
    are a dim, "all", or None (no shift, no division). None for the mixes that equal the softmax
    on small logits (a shift that is constant along each row, then the row sum): the large-logit
    test names those. Mixes that return the same numbers get the same hint.
    """
    last = ndim - 1
    row_max = (kind, shift_dim) == ("max", last)
    constant_per_row = kind is None or shift_dim in (last, "all")  # cancels against a row sum
    shift = None if kind is None else _shift_words(kind, shift_dim, ndim)
    not_max = "" if row_max else f"; and subtract each row's max, not {shift}"
    if sum_dim is None:
        exponent = "x" if kind is None else "x - max" if row_max else f"x - {shift}"
        return f"you returned exp({exponent}) without dividing by the row sum"
    if sum_dim == "all":
        if kind is None or shift_dim == "all":
            return ("rows do not sum to one: divide exp(x) by the sum of exp(x) along the same dim (keepdim=True), "
                    "not the sum of everything")
        if row_max:
            return ("rows do not sum to one: after subtracting the max, divide by the sum along dim=-1 "
                    "(keepdim=True), not the sum of everything")
        return f"rows do not sum to one: divide by the sum along dim=-1 (keepdim=True), not the sum of everything{not_max}"
    if sum_dim == last:
        if constant_per_row:
            return None
        return (f"you subtracted {shift} but summed over the last dim: a shift cancels between numerator and "
                "denominator only when it is one number per row, so subtract each row's max (over dim=-1)")
    summed = _where(sum_dim, ndim, columns="down the columns")
    if kind is None or shift_dim in (sum_dim, "all"):
        return f"you normalised {summed}; a softmax over logits normalises the last dim, dim=-1"
    if shift_dim == last:
        return (f"you subtracted {shift} but summed {summed}: the sum must run along the same dim as the max, "
                f"the last one (dim=-1){not_max}")
    also = "" if kind == "max" else f"; and shift by the max, not the {'first entry' if kind == 'first' else kind}"
    return f"you subtracted {shift} and summed {summed}: both belong on the last dim, dim=-1{also}"


def softmax_slips(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """What each mix of the usual slips returns on ``x``, keyed by its hint.

    Every shift (none; the max, min or mean over any dim or of the whole tensor; the first entry
    along any dim) meets every normalisation (the sum over any dim or of everything; no division),
    and two slips of their own: dividing by the sum of the shifted logits instead of their
    exponentials, and exponentiating the sum. Mixes that equal the softmax on small logits
    (shifting each row by its min, say) are left to the large-logit test, which names them.
    """
    shifts: dict[tuple, torch.Tensor] = {(None, None): torch.zeros(())}
    for d in range(x.dim()):
        shifts[("max", d)] = x.amax(dim=d, keepdim=True)
        shifts[("min", d)] = x.amin(dim=d, keepdim=True)
        shifts[("mean", d)] = x.mean(dim=d, keepdim=True)
        shifts[("first", d)] = x.narrow(d, 0, 1)
    shifts[("max", "all")] = x.max()
    slips: dict[str, torch.Tensor] = {}
    for (kind, shift_dim), m in shifts.items():
        e = (x - m).exp()
        sums = {d: e.sum(dim=d, keepdim=True) for d in range(x.dim())}
        sums.update({"all": e.sum(), None: torch.ones(())})
        for sum_dim, total in sums.items():
            hint = _slip_hint(kind, shift_dim, sum_dim, x.dim())
            if hint is not None:
                slips.setdefault(hint, e / total)
    shifted = x - x.amax(dim=-1, keepdim=True)
    slips["divide by the sum of the exponentials, exp(x - max), not the sum of the shifted logits"] = (
        shifted.exp() / shifted.sum(dim=-1, keepdim=True))
    slips["your denominator is exp of the summed logits; sum the exponentials instead (exp of a sum is not a sum of exps)"] = (
        shifted.exp() / shifted.sum(dim=-1, keepdim=True).exp())
    return slips


@checker("stable softmax")
def check_softmax(softmax) -> None:
    """Check a learner's ``softmax(x)`` over the last dimension."""
    x = seeded_randn(0, 4, 7)
    compare(learner_softmax(softmax, x), reference_softmax(x), what="softmax(x)", mistakes=softmax_slips(x))
    # Large logits overflow exp; rows with a wide spread catch shifts by anything but the row max
    # (the min, the mean, the first entry or the max of the whole tensor all overflow or underflow
    # to 0 / 0 in some row).
    big = torch.tensor([[1000.0, 1001.0, 1002.0], [-1000.0, -1000.0, -999.0], [0.0, 500.0, 1000.0], [-1000.0, 0.0, 3.0]])
    compare(
        learner_softmax(softmax, big),
        reference_softmax(big),
        what="softmax of large logits",
        nan_hint=(
            "NaN or Inf for large logits like [1000, 1001, 1002] or [0, 500, 1000]: exp(1000) overflows float32. "
            "Subtract each row's own max from that row before exp (a softmax does not change when a whole row "
            "shifts): not the min, the mean, the first entry or the max of the whole tensor"
        ),
    )
    batched = seeded_randn(1, 2, 3, 5)
    compare(learner_softmax(softmax, batched), reference_softmax(batched), what="softmax of a (2, 3, 5) batch",
            mistakes={f"on a (2, 3, 5) batch: {hint}": wrong for hint, wrong in softmax_slips(batched).items()})


def _softmax_inputs(rng: np.random.Generator) -> dict:
    # Rows around 1e3 overflow exp unless the row max is subtracted (kept below 2048, where one
    # float32 step is 1.2e-4, so any correct shift, the logsumexp's too, stays within tolerance).
    x = rng.standard_normal((4, int(rng.integers(2, 9)))).astype(np.float32) * 5
    x[0] += np.float32(rng.uniform(500.0, 1500.0))  # overflow bait
    x[1, 0] = 1000.0  # a wide spread: only the max shift survives it
    x[2, -1] = -1000.0
    x[3, -1] = 1000.0  # large last entry: a shift by the first entry overflows
    # Any number of leading dims (none, two or three), some rows shifted far up or down.
    leading = tuple(int(n) for n in rng.integers(1, 4, size=int(rng.choice([0, 2, 3]))))
    batched = (rng.standard_normal((*leading, int(rng.integers(2, 40)))) * 3).astype(np.float32)
    rows = batched.reshape(-1, batched.shape[-1])  # a view: shifting rows shifts batched
    rows += (rng.choice([0.0, 1.0, -1.0], size=(rows.shape[0], 1)) * rng.uniform(500.0, 1500.0)).astype(np.float32)
    return {"x": x, "batched": batched, "upstream": upstream_like(rng, x.shape),
            "upstream_batched": upstream_like(rng, batched.shape)}


SOFTMAX_RUN = HELPERS + """\
_x = torch.tensor(inputs['x'], requires_grad=True)
_batched = torch.tensor(inputs['batched'], requires_grad=True)
_results = [_call(softmax, _x), _call(softmax, _batched)]
outputs = {
    'returned': [_kind(_r) for _r in _results],
    'mutated': _MUTATED,
    'y': _array(_results[0]),
    'y_batched': _array(_results[1]),
    'grad': _backward(_results, [torch.from_numpy(inputs['upstream']), torch.from_numpy(inputs['upstream_batched'])],
                      {'x': _x, 'x_batched': _batched}),
}
del _x, _batched, _results
""" + CLEANUP


def _softmax_reference(inputs: dict) -> dict:
    x, batched = leaf(inputs["x"]), leaf(inputs["batched"])
    results = [reference_softmax(x), reference_softmax(batched)]
    upstreams = [torch.from_numpy(inputs["upstream"]), torch.from_numpy(inputs["upstream_batched"])]
    return {"returned": ["tensor", "tensor"], "y": as_array(results[0]), "y_batched": as_array(results[1]),
            "grad": backward(results, upstreams, {"x": x, "x_batched": batched})}


HINT_PROBE_OVERFLOW = (
    "exp overflows for logits around 1e3 (exp(89) is already inf in float32): subtract each row's own max "
    "before exp"
)


def _compare_softmax(outputs: dict, expected: dict) -> str | None:
    return compare_outputs(
        outputs, expected, function="softmax",
        labels={"y": "softmax(x) of a (4, n) x with rows around 1e3", "y_batched": "softmax(x) of a batch with leading dims"},
        nan_hints={"y": HINT_PROBE_OVERFLOW, "y_batched": HINT_PROBE_OVERFLOW},
    )


PROBES = {
    "check_softmax": Probe(
        exercise="ex_softmax",
        make_inputs=_softmax_inputs,
        run=SOFTMAX_RUN,
        reference=_softmax_reference,
        compare=_compare_softmax,
        # The exercise is to build the softmax: the reference and torch's own versions are off limits.
        # (torch.ops.aten.* is refused by the grader's scan for every answer; see tfedu.checks.scan.)
        forbidden=SOFTMAX_SHORTCUTS,
    ),
}


# ----------------------------------------------------------------------------- hints, in steps (tfedu.hint)

HINTS = {
    "ex_softmax": Hints(
        number="0.1",
        check="check_softmax",
        idea=(
            "The softmax of a row is exp of each entry divided by the sum of the exps of that row, so every row "
            "of the result is positive and sums to one. Subtracting one number from a whole row changes nothing "
            "(it cancels between numerator and denominator), and the row's own max is the number that helps: "
            "then the largest exponent is exactly 0, nothing overflows, and the denominator is at least 1. The "
            "classic traps: the max of the whole tensor or of a column instead of each row's, and summing over "
            "a different dim than the one you took the max over."
        ),
        approach=(
            "Everything happens along the last dim, so any number of leading batch dims come for free. (1) Take "
            "each row's max over the last dim, keeping that dim: shape (..., 1), a column that broadcasts (torch's "
            "max over a dim returns values and indices; you want the values, or use amax). (2) Subtract it from "
            "x and exponentiate: shape (..., n), every entry in (0, 1]. (3) Sum those exponentials over the last "
            "dim, again keeping it: shape (..., 1). (4) Divide. No torch.softmax or log_softmax anywhere."
        ),
        skeleton=(
            "def softmax(x):\n"
            "    row_max = ____  # (..., 1): each row's largest logit, kept as a column\n"
            "    exps = torch.exp(____)  # (..., n): every exponent is at most 0\n"
            "    return exps / ____  # (..., n): each row sums to one\n"
        ),
    ),
}
