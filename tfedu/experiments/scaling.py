"""Scaling laws: fitting power laws to losses, and how a compute budget should be split.

A language model's loss falls as a power law in its parameters N, its training tokens D and its
training compute C = 6ND (``tfedu.flops.training_compute``), flattening out towards an
irreducible loss: L(x) = a x^-alpha + c. This module holds the pieces the course uses:

- ``PF_DAY`` and ``pf_days``: compute in petaflop/s-days, the unit of Kaplan et al. (2020) and
  Brown et al. (2020), table D.1.
- ``fit_power_law``: a least-squares fit of a x^-alpha + c with ``scipy.optimize.curve_fit``,
  returning a ``PowerLawFit`` with one-sigma errors.
- ``ParametricLoss``: Hoffmann et al. (2022)'s approach 3, L(N, D) = E + A/N^alpha + B/D^beta
  (their eq. 10), and its compute-optimal N and D in closed form. ``CHINCHILLA`` holds the
  published constants, ``CHINCHILLA_REFIT`` those of Besiroglu et al. (2024), who refitted the
  paper's own data and found the published ones do not fit it.
- ``chinchilla_rule``: about 20 tokens per parameter (Hoffmann et al.'s approaches 1 and 2).
- ``kaplan_allocation``: N grows as C^0.73 (Kaplan et al. 2020, sec. 6), anchored at GPT-3.
- ``ALLOCATION_EXPONENTS``: N_opt ~ C^a and D_opt ~ C^b as Hoffmann et al. (2022), table 2,
  list them.
- ``compute_frontier``: the lowest loss reached so far as compute grows, over many runs.

Built by hand in notebooks/12_moe_and_scaling.ipynb.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from jaxtyping import Float
from numpy.typing import ArrayLike
from scipy.optimize import curve_fit

from tfedu.flops import training_compute

PF_DAY = 1e15 * 24 * 3600  # 8.64e19 FLOPs: one petaflop/s (1e15 FLOP/s) for a day
FLOPS_PER_PARAM_PER_TOKEN = training_compute(1.0, 1.0)  # the 6 of C = 6ND, read from tfedu.flops

# N_opt ~ C^a and D_opt ~ C^b (a + b = 1 because C = 6ND), Hoffmann et al. (2022), table 2.
ALLOCATION_EXPONENTS: dict[str, tuple[float, float]] = {
    "kaplan": (0.73, 0.27),  # Kaplan et al. (2020), sec. 6
    "approach 1": (0.50, 0.50),  # Hoffmann et al.: the envelope of training curves
    "approach 2": (0.49, 0.51),  # Hoffmann et al.: IsoFLOP profiles
    "approach 3": (0.46, 0.54),  # Hoffmann et al.: the parametric loss, ``CHINCHILLA`` below
}


def _positive(name: str, value: object) -> np.ndarray:
    """``value`` as a float array whose every entry is finite and > 0, or a ValueError that says so."""
    if isinstance(value, (bool, str)) or value is None:
        raise ValueError(f"{name} must be a positive number (or an array of them), got {value!r}")
    try:
        array = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number (or an array of them), got {value!r}") from None
    if array.size == 0 or not (np.isfinite(array).all() and (array > 0).all()):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    return array


def _out(array: np.ndarray) -> float | np.ndarray:
    """A plain float for a scalar result, the array otherwise."""
    return float(array) if array.ndim == 0 else array


def pf_days(flops: float | ArrayLike) -> float | np.ndarray:
    """Compute in petaflop/s-days: ``flops / PF_DAY``, with PF_DAY = 1e15 FLOP/s x 86,400 s = 8.64e19.

    Brown et al. (2020), table D.1, give GPT-3 175B 3.14E+23 FLOPs and 3.64E+03 PF-days; the
    rounded FLOPs make 3,634 PF-days, the unrounded 6 x 174.6e9 x 300e9 = 3.143e23 make 3,637.

    >>> round(pf_days(3.14e23))
    3634
    >>> f"{pf_days(training_compute(174.6e9, 300e9)):.3g}"  # the table's 3.64E+03
    '3.64e+03'
    >>> round(pf_days(5.88e23))  # Chinchilla, 6 x 70e9 params x 1.4e12 tokens
    6806
    """
    return _out(_positive("flops", flops) / PF_DAY)


# ----------------------------------------------------------------------------- power-law fits


def _round_to_error(value: float, error: float) -> tuple[str, str]:
    """``value`` and ``error`` as text, both to the decimal place of the error's first digit."""
    if not (math.isfinite(error) and error > 0):
        return f"{value:.3g}", f"{error:.1g}"
    places = min(max(0, -math.floor(math.log10(error))), 6)  # error 0.004 -> 3 places; noiseless data -> 6
    return f"{value:.{places}f}", f"{error:.{places}f}"


@dataclass(frozen=True)
class PowerLawFit:
    """L(x) = a x^-alpha + c, fitted by ``fit_power_law``, with one-sigma errors.

    ``alpha_err`` and ``c_err`` are the square roots of curve_fit's covariance diagonal; ``a_err``
    is that of the normalised fit's scale, carried back to the units of x (``fit_power_law``).

    >>> fit = PowerLawFit(a=3.2, alpha=0.071, c=1.9, a_err=0.3, alpha_err=0.004, c_err=0.1)
    >>> print(fit)
    L = 3.2 · x^-0.071 + 1.9 (alpha = 0.071 ± 0.004)
    >>> round(fit(1e6), 4), fit(np.array([1.0, 1e6])).round(4).tolist()
    (3.0999, [5.1, 3.0999])
    """

    a: float  # the scale, in the units of the data (L(1) - c)
    alpha: float  # the exponent: L - c falls by 10^alpha for every 10x in x
    c: float  # the irreducible part, L as x grows without end; 0 when fitted with offset=False
    a_err: float  # one sigma of a, in the units of x (correlated with alpha's)
    alpha_err: float  # one sigma of alpha
    c_err: float  # one sigma of c; 0 when c was held at 0

    def __call__(self, x: float | ArrayLike) -> float | np.ndarray:
        """a x^-alpha + c at ``x`` (a number or an array of positive numbers)."""
        return _out(self.a * _positive("x", x) ** -self.alpha + self.c)

    def __str__(self) -> str:
        alpha, alpha_err = _round_to_error(self.alpha, self.alpha_err)
        text = f"L = {self.a:.3g} · x^-{alpha}"
        if self.c != 0 or self.c_err != 0:
            text += f" + {self.c:.3g}"
        return f"{text} (alpha = {alpha} ± {alpha_err})"


def _law(u: np.ndarray, a: float, alpha: float, c: float = 0.0) -> np.ndarray:
    return a * u**-alpha + c


def fit_power_law(x: ArrayLike, y: ArrayLike, *, offset: bool = True,
                  p0: tuple[float, ...] | None = None) -> PowerLawFit:
    """Least-squares fit of y = a x^-alpha + c (c held at 0 when ``offset=False``) with scipy's curve_fit.

    The fit runs in u = x / geometric-mean(x), where the numbers stay near 1 whether x is a
    parameter count or a FLOP count (x^-alpha of 1e23 is far below the tolerances of the
    optimiser); a and its error are converted back: a = a_u s^alpha for s the geometric mean, with
    the error carried through the covariance of a_u and alpha. Bounds keep a, alpha and c >= 0.
    ``p0`` is the starting (a, alpha, c), or (a, alpha) with ``offset=False``, in the original
    units; by default c starts a little below min(y) and a and alpha come from a straight line
    through log(y - c) against log(x).

    >>> x = np.logspace(3, 7, 9)
    >>> fit = fit_power_law(x, 5 * x**-0.3 + 1.5)
    >>> round(fit.a, 3), round(fit.alpha, 3), round(fit.c, 3)
    (5.0, 0.3, 1.5)
    >>> noisy = (5 * x**-0.3 + 1.5) * np.random.default_rng(0).normal(1, 0.01, size=9)
    >>> print(fit_power_law(x, noisy))  # 1% noise: alpha to within its one sigma
    L = 4.96 · x^-0.30 + 1.51 (alpha = 0.30 ± 0.02)
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.ndim != 1 or y.ndim != 1:
        raise ValueError(f"x and y must be 1-D sequences of numbers, got shapes {x.shape} and {y.shape}")
    if len(x) != len(y):
        raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
    n_params = 3 if offset else 2
    if len(x) < n_params + 1:
        raise ValueError(f"need at least {n_params + 1} points to fit {n_params} parameters "
                         f"(offset={offset}) and have one left to judge the fit, got {len(x)}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("x and y must be finite: drop the runs whose loss is nan or inf")
    if (x <= 0).any():
        raise ValueError(f"x must be positive (x^-alpha), got min(x) = {x.min()!r}")
    if (y <= 0).any():
        raise ValueError(f"y must be positive (a x^-alpha + c with a, c >= 0 is), got min(y) = {y.min()!r}")

    scale = float(np.exp(np.log(x).mean()))  # the geometric mean: u = x / scale is near 1
    u = x / scale
    if p0 is None:
        c0 = 0.9 * y.min() if offset else 0.0  # below every point, so that log(y - c0) exists
        slope, intercept = np.polyfit(np.log(u), np.log(y - c0), 1)
        start = [float(np.exp(intercept)), max(-float(slope), 1e-3)] + ([c0] if offset else [])
    else:
        wanted = "(a, alpha, c)" if offset else "(a, alpha)"
        if len(p0) != n_params or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in p0):
            raise ValueError(f"p0 must be {wanted} with offset={offset}, finite and >= 0 (the bounds), got {p0!r}")
        start = [p0[0] / scale ** p0[1], *map(float, p0[1:])]  # a in the units of u = x / scale
    # Bounds: a >= 0 (L falls with x), alpha >= 0 (0 would mean no power law at all), c >= 0 (a loss).
    try:  # curve_fit reads the number of parameters off p0: two leave _law's c at 0
        params, pcov = curve_fit(_law, u, y, p0=start, bounds=([0.0] * n_params, [np.inf] * n_params), maxfev=10_000)
    except RuntimeError as error:
        what = "a x^-alpha + c" if offset else "a x^-alpha"
        raise RuntimeError(f"curve_fit could not fit y = {what} to these {len(x)} points ({error}); "
                           "try offset=False, or a starting guess p0") from error

    a_u, alpha = float(params[0]), float(params[1])
    a = a_u * scale**alpha
    # d a / d a_u = scale^alpha, d a / d alpha = a ln(scale): the delta method with the covariance.
    grad = np.array([scale**alpha, a * math.log(scale)])
    a_var = float(grad @ pcov[:2, :2] @ grad)
    errors = np.sqrt(np.abs(np.diag(pcov)))
    return PowerLawFit(
        a=a,
        alpha=alpha,
        c=float(params[2]) if offset else 0.0,
        a_err=math.sqrt(abs(a_var)),
        alpha_err=float(errors[1]),
        c_err=float(errors[2]) if offset else 0.0,
    )


# ----------------------------------------------------------------------------- compute-optimal allocation


@dataclass(frozen=True)
class ParametricLoss:
    """L(N, D) = E + A / N^alpha + B / D^beta: Hoffmann et al. (2022), approach 3, eq. 10.

    E is the loss of a perfect model on the data (the entropy of text); the other two terms are
    what a model of N parameters falls short of it, and what training on only D tokens does.
    ``optimal(C)`` minimises L along C = 6ND. Two sets of constants come with the module:
    ``CHINCHILLA`` (the paper's) and ``CHINCHILLA_REFIT`` (Besiroglu et al. 2024).

    >>> round(CHINCHILLA.loss(70e9, 1.4e12), 3)  # Chinchilla itself
    1.937
    >>> [round(e, 3) for e in CHINCHILLA.exponents]  # table 2 rounds them to 0.46 and 0.54
    [0.452, 0.548]
    """

    E: float  # the irreducible loss, nats per token
    A: float  # the scale of the parameter term
    B: float  # the scale of the data term
    alpha: float  # the exponent of N
    beta: float  # the exponent of D

    def __post_init__(self) -> None:
        for name in ("E", "A", "B", "alpha", "beta"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if name == "E" and not (number and value >= 0):  # a loss of 0 is a perfect predictor: allowed
                raise ValueError(f"E must be a non-negative number, got {value!r}")
            if name != "E" and not (number and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    @property
    def exponents(self) -> tuple[float, float]:
        """(a, b) with N_opt ~ C^a and D_opt ~ C^b: a = beta / (alpha + beta), b = alpha / (alpha + beta)."""
        return self.beta / (self.alpha + self.beta), self.alpha / (self.alpha + self.beta)

    def loss(self, N: float | ArrayLike, D: float | ArrayLike) -> float | np.ndarray:
        """The predicted loss of a model with N parameters trained on D tokens.

        >>> round(CHINCHILLA.loss(280e9, 300e9), 3)  # Gopher's size and data
        1.993
        """
        return _out(self.E + self.A / _positive("N", N) ** self.alpha + self.B / _positive("D", D) ** self.beta)

    def optimal(self, C: float | ArrayLike) -> tuple[float | np.ndarray, float | np.ndarray]:
        """(N_opt, D_opt): the N and D with 6ND = C of least loss (Hoffmann et al. 2022, eq. 4 and appendix D.2).

        Put D = C / 6N into L and set dL/dN = 0: alpha A / N^alpha = beta B / D^beta, whence

            N_opt = G (C/6)^a,  D_opt = (C/6)^b / G,  G = (alpha A / (beta B))^(1 / (alpha + beta))

        with a = beta / (alpha + beta) and b = alpha / (alpha + beta). At Chinchilla's own budget,
        6 x 70e9 x 1.4e12 = 5.88e23 FLOPs, the published constants put the optimum at 32.5B
        parameters and 3.0T tokens, less than half Chinchilla; Besiroglu et al.'s refit puts it at
        73.0B and 1.34T, next to what Hoffmann et al. trained.

        >>> N, D = CHINCHILLA.optimal(5.88e23)
        >>> f"{N:.3g} params, {D:.3g} tokens"
        '3.25e+10 params, 3.02e+12 tokens'
        >>> N, D = CHINCHILLA_REFIT.optimal(5.88e23)
        >>> f"{N:.3g} params, {D:.3g} tokens"
        '7.3e+10 params, 1.34e+12 tokens'
        """
        budget = _positive("C", C) / FLOPS_PER_PARAM_PER_TOKEN  # C / 6 = N D
        a, b = self.exponents
        G = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        return _out(G * budget**a), _out(budget**b / G)


# Hoffmann et al. (2022), eq. 10: the published fit of approach 3.
CHINCHILLA = ParametricLoss(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
# Besiroglu, Erdil, Barnett & You (2024), "Chinchilla Scaling: A replication attempt": the same
# model refitted to the data read off the paper's figure 4, which the published constants do not fit.
CHINCHILLA_REFIT = ParametricLoss(E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658)


def chinchilla_rule(
    C: float | ArrayLike, tokens_per_param: float = 20
) -> tuple[float | np.ndarray, float | np.ndarray]:
    """(N, D) with D = tokens_per_param x N and 6ND = C: N = sqrt(C / (6 r)), D = r N.

    Hoffmann et al.'s approaches 1 and 2 found N_opt and D_opt both growing about as C^0.5
    (``ALLOCATION_EXPONENTS``), so the ratio D / N stays put, at about 20 tokens a parameter.
    Chinchilla's own budget gives back 70B and 1.4T by construction (1.4T / 70B = 20). At Gopher's
    budget, 5.76e23 FLOPs, the rule says 69.3B and 1.39T; the paper's table 3 (approach 1) lists
    67B and 1.5T there, which is about 21 tokens a parameter (5.76e23 / (6 x 67e9) = 1.43T).

    >>> N, D = chinchilla_rule(6 * 70e9 * 1.4e12)
    >>> round(N / 1e9, 6), round(D / 1e12, 6)
    (70.0, 1.4)
    >>> N, D = chinchilla_rule(5.76e23)
    >>> round(N / 1e9, 1), round(D / 1e12, 2)
    (69.3, 1.39)
    """
    if isinstance(tokens_per_param, bool) or not isinstance(tokens_per_param, (int, float)) or not (
        math.isfinite(tokens_per_param) and tokens_per_param > 0
    ):
        raise ValueError(f"tokens_per_param must be a positive number, got {tokens_per_param!r}")
    N = np.sqrt(_positive("C", C) / (FLOPS_PER_PARAM_PER_TOKEN * tokens_per_param))
    return _out(N), _out(tokens_per_param * N)


def kaplan_allocation(
    C: float | ArrayLike, *, anchor: tuple[float, float] = (175e9, 300e9)
) -> tuple[float | np.ndarray, float | np.ndarray]:
    """(N, D) when N grows as C^0.73 (Kaplan et al. 2020, sec. 6), scaled from an anchor model.

    Kaplan et al.'s law for the optimal N has a prefactor in units we cannot reproduce exactly
    (non-embedding parameters; C_min, the compute at the best batch size), so this function does
    not use it. It keeps only the exponent and scales from an anchor (N0, D0) taken to sit on
    Kaplan's optimum: by default GPT-3, 175B parameters and 300B tokens, whose size Brown et al.
    (2020) chose following Kaplan's laws. So N = N0 (C / C0)^0.73 with C0 = 6 N0 D0, and
    D = C / 6N, which grows as C^0.27.

    At Gopher's budget, 5.76e23 FLOPs, this gives 272B parameters and 353B tokens: close to the
    280B and 300B Gopher was trained with (Rae et al. 2021), and 3.9 times the 69.3B of
    ``chinchilla_rule``.

    >>> N, D = kaplan_allocation(6 * 175e9 * 300e9)  # the anchor's own budget gives it back
    >>> round(N / 1e9, 6), round(D / 1e9, 6)
    (175.0, 300.0)
    >>> N, D = kaplan_allocation(5.76e23)
    >>> round(N / 1e9), round(D / 1e9)
    (272, 353)
    """
    if not (isinstance(anchor, (tuple, list)) and len(anchor) == 2):
        raise ValueError(f"anchor must be a pair (n_params, n_tokens), got {anchor!r}")
    C0 = training_compute(*anchor)  # also checks that both are positive numbers
    a, _ = ALLOCATION_EXPONENTS["kaplan"]
    C = _positive("C", C)
    N = anchor[0] * (C / C0) ** a
    return _out(N), _out(C / (FLOPS_PER_PARAM_PER_TOKEN * N))


def compute_frontier(
    compute: ArrayLike, loss: ArrayLike
) -> tuple[Float[np.ndarray, " frontier"], Float[np.ndarray, " frontier"]]:
    """The compute-efficient frontier of many runs' (compute, loss) points: the lower envelope.

    Sort the points by compute and keep each one whose loss is below that of every point with
    less compute: the best loss any run reached on that budget or less (Kaplan et al. 2020,
    figure 1; Hoffmann et al. 2022, approach 1). Of several points at the same compute only the
    lowest can be kept; a tie in loss keeps the cheaper point. Returns (compute, loss) of the
    kept points, in order of compute.

    >>> c, l = compute_frontier([1, 2, 3, 4, 5], [5.0, 4.0, 4.5, 3.0, 3.0])
    >>> c.tolist(), l.tolist()
    ([1.0, 2.0, 4.0], [5.0, 4.0, 3.0])
    """
    compute, loss = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    if compute.ndim != 1 or compute.shape != loss.shape or len(compute) == 0:
        raise ValueError(f"compute and loss must be 1-D, non-empty and of the same length, got shapes "
                         f"{compute.shape} and {loss.shape}")
    _positive("compute", compute)
    if not np.isfinite(loss).all():
        raise ValueError("loss must be finite: drop the runs whose loss is nan or inf")
    order = np.lexsort((loss, compute))  # by compute, and the lowest loss first at equal compute
    compute, loss = compute[order], loss[order]
    best_before = np.concatenate([[np.inf], np.minimum.accumulate(loss)[:-1]])
    keep = loss < best_before
    return compute[keep], loss[keep]
