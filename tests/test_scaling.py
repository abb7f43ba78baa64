"""tfedu.experiments.scaling: power-law fits recover known exponents; the allocations match the published numbers."""

import dataclasses
import doctest
import math

import numpy as np
import pytest

from tfedu.experiments import scaling
from tfedu.flops import training_compute
from tfedu.experiments.scaling import (
    ALLOCATION_EXPONENTS,
    CHINCHILLA,
    CHINCHILLA_REFIT,
    PF_DAY,
    ParametricLoss,
    PowerLawFit,
    chinchilla_rule,
    compute_frontier,
    fit_power_law,
    kaplan_allocation,
    pf_days,
)

CHINCHILLA_BUDGET = 6 * 70e9 * 1.4e12  # 5.88e23: Chinchilla, 70B parameters on 1.4T tokens
GOPHER_BUDGET = 5.76e23  # Hoffmann et al. (2022), table 3: one "Gopher unit" of FLOPs

A_TRUE, ALPHA_TRUE, C_TRUE = 5.0, 0.3, 1.5
X = np.logspace(3, 7, 17)


def law(x):
    return A_TRUE * x**-ALPHA_TRUE + C_TRUE


def test_docstring_examples():
    failures, tried = doctest.testmod(scaling, raise_on_error=False)
    assert tried >= 15 and failures == 0


# ----------------------------------------------------------------------------- PF-days


def test_pf_day_is_a_petaflop_per_second_for_a_day():
    assert PF_DAY == 8.64e19 == 1e15 * 24 * 3600
    assert pf_days(PF_DAY) == 1.0
    assert pf_days(np.array([PF_DAY, 2 * PF_DAY])).tolist() == [1.0, 2.0]


def test_gpt3_pf_days_match_brown_et_al_table_d1():
    # Table D.1: 3.14E+23 FLOPs and 3.64E+03 PF-days; the PF-days come from the unrounded FLOPs.
    assert pf_days(3.14e23) == pytest.approx(3.64e3, rel=2e-3)
    assert f"{pf_days(training_compute(174.6e9, 300e9)):.2e}" == "3.64e+03"


def test_chinchilla_pf_days():
    assert training_compute(70e9, 1.4e12) == pytest.approx(5.88e23)
    assert pf_days(CHINCHILLA_BUDGET) == pytest.approx(6.8e3, rel=1e-3)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1e23", None, True, []])
def test_pf_days_rejects_what_is_not_a_positive_number(bad):
    with pytest.raises(ValueError, match="flops must be"):
        pf_days(bad)


# ----------------------------------------------------------------------------- power-law fits


def test_fit_recovers_a_noiseless_power_law_with_offset():
    fit = fit_power_law(X, law(X))
    assert (fit.a, fit.alpha, fit.c) == pytest.approx((A_TRUE, ALPHA_TRUE, C_TRUE), rel=1e-6)
    assert fit(X) == pytest.approx(law(X))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_the_exponent_through_one_percent_noise(seed):
    rng = np.random.default_rng(seed)
    y = law(X) * (1 + 0.01 * rng.standard_normal(len(X)))
    fit = fit_power_law(X, y)
    assert abs(fit.alpha - ALPHA_TRUE) < 3 * fit.alpha_err  # the error bars mean what they say
    assert abs(fit.c - C_TRUE) < 3 * fit.c_err
    assert fit.alpha == pytest.approx(ALPHA_TRUE, abs=0.05)
    assert fit.c == pytest.approx(C_TRUE, abs=0.05)
    assert 0 < fit.alpha_err < 0.05 and 0 < fit.a_err and 0 < fit.c_err


def test_fit_with_offset_finds_no_offset_in_a_pure_power_law():
    fit = fit_power_law(X, 5 * X**-0.3)
    assert (fit.a, fit.alpha) == pytest.approx((5.0, 0.3), rel=1e-4) and fit.c == pytest.approx(0, abs=1e-4)  # c on its bound


def test_fit_without_offset_on_a_pure_power_law():
    y = 400.0 * X**-0.34
    fit = fit_power_law(X, y, offset=False)
    assert (fit.a, fit.alpha, fit.c, fit.c_err) == pytest.approx((400.0, 0.34, 0.0, 0.0), rel=1e-6)
    noisy = y * (1 + 0.01 * np.random.default_rng(0).standard_normal(len(X)))
    fit = fit_power_law(X, noisy, offset=False)
    assert abs(fit.alpha - 0.34) < 3 * fit.alpha_err
    assert abs(fit.a - 400.0) < 3 * fit.a_err  # a's error is carried back from the normalised fit


def test_fit_on_compute_sized_x_stays_conditioned():
    compute = np.logspace(18, 24, 10)  # FLOPs: x^-alpha is ~1e-7 here, hopeless without normalising
    y = 480.0 * compute**-0.05 + 1.8
    fit = fit_power_law(compute, y)
    assert (fit.a, fit.alpha, fit.c) == pytest.approx((480.0, 0.05, 1.8), rel=1e-4)


def test_fit_accepts_a_starting_guess_in_original_units():
    fit = fit_power_law(X, law(X), p0=(4.0, 0.2, 1.0))
    assert (fit.a, fit.alpha, fit.c) == pytest.approx((A_TRUE, ALPHA_TRUE, C_TRUE), rel=1e-6)
    fit = fit_power_law(X, 5 * X**-0.3, offset=False, p0=(1.0, 0.5))
    assert fit.alpha == pytest.approx(0.3)


def test_power_law_fit_is_frozen_calls_on_floats_and_arrays_and_prints():
    fit = PowerLawFit(a=3.2, alpha=0.071, c=1.9, a_err=0.3, alpha_err=0.004, c_err=0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fit.alpha = 0.5
    assert isinstance(fit(10.0), float) and fit(10.0) == pytest.approx(3.2 * 10**-0.071 + 1.9)
    assert fit(np.array([10.0, 100.0])).shape == (2,)
    assert str(fit) == "L = 3.2 · x^-0.071 + 1.9 (alpha = 0.071 ± 0.004)"
    assert str(dataclasses.replace(fit, c=0.0, c_err=0.0)) == "L = 3.2 · x^-0.071 (alpha = 0.071 ± 0.004)"


@pytest.mark.parametrize(
    "x, y, kwargs, message",
    [
        ([1, 2, 3, 4], [1, 2, 3], {}, "same length"),
        ([1, 2, 3], [3, 2, 1], {}, "at least 4 points"),
        ([1, 2], [2, 1], {"offset": False}, "at least 3 points"),
        ([1, 0, 3, 4], [4, 3, 2, 1], {}, "x must be positive"),
        ([1, -2, 3, 4], [4, 3, 2, 1], {}, "x must be positive"),
        ([1, 2, 3, 4], [4, float("nan"), 2, 1], {}, "finite"),
        ([1, 2, float("inf"), 4], [4, 3, 2, 1], {}, "finite"),
        ([1, 2, 3, 4], [4, 3, 0, 1], {}, "y must be positive"),
        ([[1, 2], [3, 4]], [[4, 3], [2, 1]], {}, "1-D"),
        ([1, 2, 3, 4], [4, 3, 2, 1], {"p0": (1.0, 0.5)}, r"p0 must be \(a, alpha, c\)"),
        ([1, 2, 3, 4], [4, 3, 2, 1], {"p0": (1.0, -0.5, 1.0)}, ">= 0"),
    ],
)
def test_fit_names_bad_input(x, y, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fit_power_law(x, y, **kwargs)


def test_a_failed_fit_says_what_was_fitted_and_what_to_try(monkeypatch):
    def gives_up(*args, **kwargs):
        raise RuntimeError("Optimal parameters not found: The maximum number of function evaluations is exceeded.")

    monkeypatch.setattr(scaling, "curve_fit", gives_up)
    with pytest.raises(RuntimeError, match=r"a x\^-alpha \+ c.*offset=False.*p0"):
        fit_power_law(X, law(X))


# ----------------------------------------------------------------------------- Chinchilla's parametric loss


@pytest.mark.parametrize("model", [CHINCHILLA, CHINCHILLA_REFIT], ids=["published", "refit"])
@pytest.mark.parametrize("C", [1e21, GOPHER_BUDGET, 1e26])
def test_closed_form_optimum_is_the_minimum_along_the_budget(model, C):
    N_opt, D_opt = model.optimal(C)
    assert training_compute(N_opt, D_opt) == pytest.approx(C)
    N = N_opt * np.logspace(-1, 1, 2001)  # a scan along 6ND = C, 10x either side
    losses = model.loss(N, C / (6 * N))
    assert N[np.argmin(losses)] == pytest.approx(N_opt, rel=5e-3)
    assert losses.min() >= model.loss(N_opt, D_opt) - 1e-12


def test_allocation_exponents_match_hoffmann_table_2():
    assert ALLOCATION_EXPONENTS == {
        "kaplan": (0.73, 0.27), "approach 1": (0.50, 0.50), "approach 2": (0.49, 0.51), "approach 3": (0.46, 0.54)
    }
    assert all(a + b == pytest.approx(1) for a, b in ALLOCATION_EXPONENTS.values())
    # The published approach-3 constants give a = 0.28 / 0.62 = 0.452, which table 2 rounds to 0.46.
    assert CHINCHILLA.exponents == pytest.approx(ALLOCATION_EXPONENTS["approach 3"], abs=0.01)
    for model in (CHINCHILLA, CHINCHILLA_REFIT):  # N_opt ~ C^a, measured
        (N1, D1), (N2, D2) = model.optimal(1e20), model.optimal(1e26)
        assert math.log(N2 / N1) / 6 / math.log(10) == pytest.approx(model.exponents[0])
        assert math.log(D2 / D1) / 6 / math.log(10) == pytest.approx(model.exponents[1])


def test_published_constants_put_the_optimum_far_below_chinchilla():
    N, D = CHINCHILLA.optimal(CHINCHILLA_BUDGET)
    assert N == pytest.approx(32.5e9, rel=1e-2) and D == pytest.approx(3.02e12, rel=1e-2)
    N, D = CHINCHILLA.optimal(GOPHER_BUDGET)
    assert N == pytest.approx(32.2e9, rel=1e-2) and D == pytest.approx(2.98e12, rel=1e-2)
    assert 30e9 < N < 40e9  # not the 67-70B that approaches 1 and 2 (and Chinchilla) say


def test_refit_puts_the_optimum_near_chinchilla():
    N, D = CHINCHILLA_REFIT.optimal(CHINCHILLA_BUDGET)
    assert N == pytest.approx(73.0e9, rel=1e-2) and D == pytest.approx(1.34e12, rel=1e-2)
    N, D = CHINCHILLA_REFIT.optimal(GOPHER_BUDGET)
    assert N == pytest.approx(72.2e9, rel=1e-2) and D == pytest.approx(1.33e12, rel=1e-2)
    assert N == pytest.approx(70e9, rel=0.05)


def test_parametric_loss_is_frozen_and_checks_its_constants():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CHINCHILLA.E = 0.0
    with pytest.raises(ValueError, match="alpha must be a positive number"):
        ParametricLoss(E=1.69, A=406.4, B=410.7, alpha=0.0, beta=0.28)
    with pytest.raises(ValueError, match="E must be a non-negative number"):
        ParametricLoss(E=-1.0, A=406.4, B=410.7, alpha=0.34, beta=0.28)
    with pytest.raises(ValueError, match="C must be positive"):
        CHINCHILLA.optimal(-1.0)
    with pytest.raises(ValueError, match="N must be positive"):
        CHINCHILLA.loss(0, 1e12)


# ----------------------------------------------------------------------------- the 20-token rule and Kaplan


def test_twenty_tokens_rule_gives_chinchilla_back_by_construction():
    N, D = chinchilla_rule(CHINCHILLA_BUDGET)
    assert (N, D) == pytest.approx((70e9, 1.4e12))
    assert D / N == pytest.approx(20)


def test_twenty_tokens_rule_at_gophers_budget_against_hoffmann_table_3():
    N, D = chinchilla_rule(GOPHER_BUDGET)
    assert (N, D) == pytest.approx((69.3e9, 1.386e12), rel=1e-3)
    # Table 3 (approach 1) lists 67B and 1.5T: the rule, a rounded 20, lands within 4% of the 67B ...
    assert N == pytest.approx(67e9, rel=0.04)
    assert 1.35e12 <= D <= 1.55e12  # ... and its tokens round to 1.4T
    # ... while 21.4 tokens a parameter, what the table's row implies, gives its 67B exactly.
    assert chinchilla_rule(GOPHER_BUDGET, tokens_per_param=GOPHER_BUDGET / (6 * 67e9**2))[0] == pytest.approx(67e9)


def test_twenty_tokens_rule_on_arrays_and_bad_input():
    N, D = chinchilla_rule(np.array([6e20, 6e22]), tokens_per_param=10)
    assert N.tolist() == pytest.approx([math.sqrt(1e19), math.sqrt(1e21)])  # sqrt(C / 60)
    assert D.tolist() == pytest.approx((10 * N).tolist())
    with pytest.raises(ValueError, match="tokens_per_param must be a positive number"):
        chinchilla_rule(1e23, tokens_per_param=0)


def test_kaplan_allocation_returns_its_anchor_and_grows_as_published():
    N, D = kaplan_allocation(training_compute(175e9, 300e9))
    assert (N, D) == pytest.approx((175e9, 300e9))
    N, D = kaplan_allocation(1e21, anchor=(1e9, 20e9))
    assert (N, D) == pytest.approx((1e9 * (1e21 / 1.2e20) ** 0.73, 1e21 / (6 * N)))
    (N1, D1), (N2, D2) = kaplan_allocation(1e20), kaplan_allocation(1e26)
    assert math.log10(N2 / N1) / 6 == pytest.approx(0.73)
    assert math.log10(D2 / D1) / 6 == pytest.approx(0.27)


def test_kaplan_at_gophers_budget_is_several_times_chinchillas_rule():
    N, D = kaplan_allocation(GOPHER_BUDGET)
    assert (N, D) == pytest.approx((272e9, 353e9), rel=1e-2)
    assert N / chinchilla_rule(GOPHER_BUDGET)[0] == pytest.approx(3.9, abs=0.05)
    assert N == pytest.approx(280e9, rel=0.05)  # Gopher's size (Rae et al. 2021), trained at about this budget


def test_kaplan_allocation_takes_the_anchor_as_any_pair():
    assert kaplan_allocation(1e23, anchor=[175e9, 300e9]) == kaplan_allocation(1e23)


@pytest.mark.parametrize("anchor", [(175e9,), 175e9, (0, 300e9), (175e9, -1), (175e9, "300e9")])
def test_kaplan_allocation_names_a_bad_anchor(anchor):
    with pytest.raises(ValueError, match="anchor must be a pair|must be a positive number"):
        kaplan_allocation(1e23, anchor=anchor)


# ----------------------------------------------------------------------------- the compute frontier


def test_frontier_keeps_only_points_that_beat_everything_cheaper():
    rng = np.random.default_rng(0)
    compute = rng.uniform(1, 100, size=200)
    loss = 2 + 5 / compute + rng.uniform(0, 1, size=200)
    c, l = compute_frontier(compute, loss)
    assert np.all(np.diff(c) > 0) and np.all(np.diff(l) < 0)
    for ci, li in zip(c, l):  # each kept point beats every cheaper point ...
        assert li < loss[compute < ci].min(initial=np.inf)
    for ci, li in zip(compute, loss):  # ... and every dropped one is matched by a cheaper-or-equal kept one
        assert (ci in c) or l[c <= ci].min() <= li


def test_frontier_passes_its_shape_check(typechecked):
    c, l = typechecked(compute_frontier)(np.array([1.0, 2.0, 3.0]), np.array([3.0, 1.0, 2.0]))
    assert c.tolist() == [1.0, 2.0] and l.tolist() == [3.0, 1.0]


def test_frontier_on_ties_and_a_single_point():
    c, l = compute_frontier([2, 1, 2, 3], [1.0, 3.0, 2.0, 1.0])
    assert c.tolist() == [1.0, 2.0] and l.tolist() == [3.0, 1.0]
    c, l = compute_frontier([5.0], [2.0])
    assert c.tolist() == [5.0] and l.tolist() == [2.0]


@pytest.mark.parametrize(
    "compute, loss, message",
    [([1, 2], [1.0], "same length"), ([], [], "non-empty"), ([0, 1], [2.0, 1.0], "compute must be positive"),
     ([1, 2], [2.0, float("nan")], "loss must be finite")],
)
def test_frontier_names_bad_input(compute, loss, message):
    with pytest.raises(ValueError, match=message):
        compute_frontier(compute, loss)
